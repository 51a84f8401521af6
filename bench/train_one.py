"""Train one (trainer, implementation, prompt length) configuration for a few optimizer steps and print one JSON line
with its throughput and peak memory. `bench/throughput_memory.py` runs it (`child_entry`) in a fresh process per
configuration, so that one run's allocations do not raise the next one's peak.

Throughput is real tokens (prompt once per response, plus the responses; no padding) per second of the steps after
the first. The first step is a warm-up on a short row: it allocates the gradients and the optimizer state. Peak memory
is the growth of the peak RSS (`ru_maxrss`) over its value right after the model was built: gradients, optimizer
state, activations and logits, not the weights; the growth after the warm-up step is reported as the floor that
does not depend on the row length.

    python bench/train_one.py --trainer grm --impl ours --prompt-length 4096 --steps 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def run_config(trainer: str, impl: str, prompt_length: int, response_length: int = 64, steps: int = 3,
               warmup_prompt_length: int | None = 64, threads: int | None = None, seed: int = 0) -> dict:
    """Train one configuration in this process and return its record (see the module docstring)."""
    import torch

    from trl_longrm.testing_utils import build_chat_tokenizer

    if steps < 2:
        raise ValueError("steps must be at least 2 (one warm-up step, one timed)")
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    tokenizer = build_chat_tokenizer()
    groups = common.random_groups(steps, prompt_length, response_length, tokenizer.eos_token_id, seed,
                                  warmup_prompt_length)
    model = common.build_model("causal-lm" if trainer == "grm" else "seq-cls", tokenizer, seed=seed)
    base = common.maxrss_bytes()
    timer = common.StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        instance = common.build_trainer(trainer, impl, model, tokenizer, groups, output_dir, steps, [timer])
        before_train = common.maxrss_bytes()
        instance.train()
    if len(timer.times) != steps:
        raise RuntimeError(f"expected {steps} timed steps, got {len(timer.times)}")
    tokens = [common.group_tokens(g) for g in groups]
    timed = slice(1, None)
    return {
        "trainer": trainer,
        "impl": impl,
        "prompt_length": prompt_length,
        "status": "ok",
        "tokens_per_step": tokens,
        "step_seconds": [round(t, 4) for t in timer.times],
        "tokens_per_s": sum(tokens[timed]) / sum(timer.times[timed]),
        # About the thread count on an idle machine; lower when other processes took cores during the timed steps.
        "cpu_per_wall": sum(timer.cpu_times[timed]) / sum(timer.times[timed]),
        "peak_mem_bytes": common.maxrss_bytes() - base,
        "floor_mem_bytes": timer.maxrss[0] - base,  # after the short warm-up step
        "trainer_init_mem_bytes": before_train - base,
        "model_maxrss_bytes": base,
        "num_params": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": round(time.perf_counter() - started, 2),
    }


def child_entry(config: dict, result_path: str) -> None:
    """Entry point of a forked benchmark process: run `config`, write the record (or the error) as JSON."""
    try:
        record = run_config(**config)
    except Exception:  # noqa: BLE001 - the parent records the failure and goes on
        record = {"status": "error", "error_tail": traceback.format_exc().strip().splitlines()[-5:]}
    Path(result_path).write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=common.TRAINERS, required=True, help="grm (SimPO) or disrm (Bradley-Terry).")
    parser.add_argument("--impl", choices=common.IMPLS, required=True, help="ours (trl_longrm) or stock (TRL).")
    parser.add_argument("--prompt-length", type=int, required=True, help="Tokens of the prompt shared by both responses.")
    parser.add_argument("--response-length", type=int, default=64, help="Longest response; each has L/2..L tokens.")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps; the first is warm-up, not timed.")
    parser.add_argument("--warmup-prompt-length", type=int, default=64,
                        help="Prompt of the warm-up step: short, so that the peak RSS after it is the row-independent "
                        "floor (gradients, optimizer state).")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the data and the model weights.")
    cli = parser.parse_args()
    record = run_config(cli.trainer, cli.impl, cli.prompt_length, cli.response_length, cli.steps,
                        cli.warmup_prompt_length, cli.threads, cli.seed)
    print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
