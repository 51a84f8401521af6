# Every target sets up what it needs on a fresh machine: a venv in .venv with torch (CPU build) and the package.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-fast demo bench bench-quick lint clean

$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build lies on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,deepspeed,qlora]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# CPU benchmark of our trainers against stock TRL (not part of the tests); the last line printed is a JSON of ratios.
bench: $(STAMP)
	$(PY) bench/run.py --preset full --out bench/results

bench-quick: $(STAMP)
	$(PY) bench/run.py --preset quick --out bench/results/quick

lint: $(STAMP)
	$(VENV)/bin/ruff check trl_longrm tests bench

demo: $(STAMP)
	$(PY) -m trl_longrm.demo --output-dir demo_outputs

clean:
	rm -rf $(VENV) .pytest_cache
