"""Do 2-process runs end with exit 0? N consecutive runs of a plain user script (no clean-up of its own) under
`torchrun --nproc_per_node 2`, per mode, counting non-zero exits (issue 31: a rank aborting at interpreter exit with
"terminate called without an active exception" after a successful `train()`).

Modes: `disrm_ring` (SimPODisRMTrainer, a ring of 2, shared prefixes), `grm_ring` (SimPOGRMTrainer, a ring of 2,
shared prefixes), `disrm_ddp` (SimPODisRMTrainer, 2 data-parallel replicas). One torch thread per process.

The cause, found with gdb on an aborting rank: a gloo worker thread still releasing the last collective's work (the HF
Trainer's `store_flos` all-gather at the end of `train()`) held the last reference to a Python tensor and asked for the
GIL after the interpreter had started finalising; Python ends such a thread with a forced unwind, which a C++
destructor turns into `std::terminate`. The trainers' exit hook (`release_process_groups_at_exit`) drops the
DDP/DeepSpeed wrappers that keep the groups alive and destroys the groups, which joins their threads while Python still
runs.

    python bench/clean_exit.py --runs 100                 # one JSON line; failures' stderr tails in --log-dir
    python bench/clean_exit.py --runs 20 --modes disrm_ring
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


MODES = ("disrm_ring", "grm_ring", "disrm_ddp")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def user_script(mode: str, output_dir: str) -> None:
    """What a user writes: build a trainer, `train()`, and return (the script ends)."""
    import random

    from datasets import Dataset

    from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer, SimPOGRMConfig, SimPOGRMTrainer
    from trl_longrm.testing_utils import _WORDS, build_chat_tokenizer, build_tiny_model

    rng = random.Random(0)
    words = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))  # noqa: E731
    rows = [{"prompt": [{"role": "user", "content": words(40)}], "chosen": words(6), "rejected": [words(5), words(7)]}
            for _ in range(8)]  # fmt: skip
    tokenizer = build_chat_tokenizer()
    args = dict(output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], max_steps=2, logging_steps=1,
                per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True,
                sequence_parallel_size=1 if mode.endswith("ddp") else 2)  # fmt: skip
    if mode.startswith("grm"):
        trainer = SimPOGRMTrainer(model=build_tiny_model("llama", "causal-lm", tokenizer), args=SimPOGRMConfig(**args),
                                  train_dataset=Dataset.from_list(rows), processing_class=tokenizer)  # fmt: skip
    else:
        trainer = SimPODisRMTrainer(model=build_tiny_model("qwen3", "seq-cls", tokenizer),
                                    args=SimPODisRMConfig(**args), train_dataset=Dataset.from_list(rows),
                                    processing_class=tokenizer)  # fmt: skip
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--log-dir", default=None, help="Where the stderr of failed runs goes (default: a temp dir).")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        user_script(cli.worker, cli.output_dir)
        return
    log_dir = Path(cli.log_dir or tempfile.mkdtemp(prefix="clean_exit_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TRL_EXPERIMENTAL_SILENCE": "1"}
    report = {"runs_per_mode": cli.runs, "nonzero_exits": {}, "aborts": {}, "seconds_per_run": {}}
    for mode in cli.modes:
        failures, aborts, started = 0, 0, time.monotonic()
        for run in range(cli.runs):
            with tempfile.TemporaryDirectory() as output_dir:
                command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), __file__, "--worker", mode, "--output-dir",
                           output_dir]  # fmt: skip
                result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode:
                failures += 1
                aborts += "terminate called" in result.stderr
                (log_dir / f"{mode}_{run}.log").write_text(result.stdout[-20000:] + "\n--- stderr ---\n" +
                                                           result.stderr[-20000:])  # fmt: skip
        report["nonzero_exits"][mode] = failures
        report["aborts"][mode] = aborts
        report["seconds_per_run"][mode] = round((time.monotonic() - started) / cli.runs, 1)
    report["log_dir"] = str(log_dir)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
