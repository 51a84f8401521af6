"""`bench/gpu_check.sh`, the one script a lent GPU machine runs: a GPU call is rare and short, so the script must not
fail there on a typo. Checked here on CPU: it parses, every stage it runs on the GPU has a CPU rehearsal, and one
stage's rehearsal runs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _stages(branch: str) -> set[str]:
    return set(re.findall(r"^\s*stage (\w+) \d+", branch, flags=re.MULTILINE))


def test_the_script_parses_and_every_gpu_stage_is_rehearsed():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    start = text.index('if [ "$MODE" = rehearse ]; then\n    # Every stage')
    middle = text.index("\nelse\n", start)
    rehearse, gpu = text[start:middle], text[middle : text.index("\nfi\necho", middle)]
    assert _stages(gpu) and _stages(gpu) <= _stages(rehearse) | {"env"}, _stages(gpu) - _stages(rehearse)
    default = re.search(r'^STAGES="([^"]+)"', text, flags=re.MULTILINE).group(1).split(",")
    assert set(default) <= _stages(gpu) | {"env"}


@pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="bf16 matmuls are emulated on a CPU without AVX-512: the rehearsal's bf16 step at Qwen3-0.6B's vocabulary "
    "ran past 10 minutes on such a machine (2 cores, 2026-11-28); it runs on AVX-512 machines",
)
def test_rehearsal_of_the_capped_long_rows_stage(tmp_path):
    """The stage that emulates a 16 GB GPU runs its attempt with the cap and the long-row settings (on CPU the cap is
    recorded, not applied)."""
    env = {**os.environ, "PY_REHEARSE": sys.executable, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    subprocess.run(["bash", str(SCRIPT), "--rehearse", "--out", str(tmp_path), "--stages", "long_rows_capped"],
                   check=True, cwd=ROOT, env=env, capture_output=True, timeout=960)  # fmt: skip
    (stage,) = [json.loads(line) for line in (tmp_path / "stages.jsonl").read_text().splitlines()
                if json.loads(line)["stage"] == "long_rows_capped"]  # fmt: skip
    assert stage["rc"] == 0, (tmp_path / "long_rows_capped.log").read_text()[-2000:]
    results = [json.loads(line[len("RESULT "):]) for line in (tmp_path / "long_rows_capped.log").read_text().splitlines()
               if line.startswith("RESULT ")]  # fmt: skip
    assert results and results[-1]["status"] == "ok"
    assert results[-1]["memory_cap_gib"] == 16.0 and results[-1]["long_rows"] is True and results[-1]["steps"] == 1
