"""Does the plan's ranking hold where it can be measured (issue 63)? `trl-longrm plan`'s search on CPU with a small card
(`--device cpu --device_memory_gib`), for a few shapes (GRM, DisRM, SFT; full parameters and LoRA): each of the three
fastest proposals is run as the search planned it, its peak measured (the allocator's live tensors, as the memory
plan's CPU validation measures it) against its plan and the card, and the three are timed side by side (their steps
interleaved, round after round, in one process), to check that the top proposal is no slower than the next two by
more than the step-time model's stated error (its leave-one-out mean error on the GPU runs,
`bench/results/step_time_model.json`).

    OMP_NUM_THREADS=2 .venv/bin/python bench/plan_ranking.py --out bench/results/plan_ranking.json

The step-time model's rates are a GPU's (the card's, else an H100's) even for a CPU plan: what is checked is the
order it gives, on a machine where the same settings cost what they cost there (recompute, offload copies, the
tiled MLP's loop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402,F401  (the environment of the benches: offline, quiet)


GIB = 2**30


def cases():
    import torch
    from test_memory_plan import llama_config, model_config

    from trl_longrm.memory_plan import GroupShape

    # name -> (stage, model config, shape, method, card GiB, dtype[, rows per step])
    return {
        "grm_full": ("simpo_grm", model_config(layers=6), GroupShape(2048, 256, 4), "full", 0.3, torch.float32),
        "disrm_lora": ("simpo_disrm", llama_config(layers=6), GroupShape(3072, 256, 4), "lora", 0.25, torch.float32),
        "sft_full": ("sft", model_config(layers=6), GroupShape(3840, 256, 0), "full", 0.3, torch.float32),
        # 4 groups a step: one a micro-batch accumulated, or two (what the card fits) twice.
        "grm_full_rows4": ("simpo_grm", model_config(layers=6), GroupShape(2048, 256, 4), "full", 0.3, torch.float32,
                           4),
    }


class StepClock:
    """A trainer callback timing each optimizer step (`on_step_begin` to `on_step_end`)."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.seconds.append(time.perf_counter() - clock.started)

        self.callback, self.seconds, self.started = _Callback(), [], 0.0


def timed_steps(stage, training_args, model_config, shape, peft_config, dtype, steps: int) -> list[float]:
    """Seconds of each of `steps` optimizer steps of `stage`'s trainer with these settings (a fresh model, seeded)."""
    import torch

    from trl_longrm.memory.activation_offload import CountingHostStore, use_host_store
    from trl_longrm.memory_plan.model import build_model
    from trl_longrm.memory_plan.trace import fresh_args, synthetic_dataset
    from trl_longrm.stages import stage_classes
    from trl_longrm.testing_utils import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()
    torch.manual_seed(0)
    model = build_model(stage, model_config, dtype)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        args = fresh_args(training_args, output_dir=tmp, max_steps=steps, save_strategy="no", report_to=[],
                          disable_tqdm=True, logging_steps=steps)  # fmt: skip
        groups = steps * training_args.gradient_accumulation_steps * training_args.per_device_train_batch_size
        dataset = synthetic_dataset(stage, shape, groups, model_config.vocab_size, tokenizer.eos_token_id)
        trainer = stage_classes(stage)[0](model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                          peft_config=peft_config, callbacks=[clock.callback])  # fmt: skip
        with use_host_store(CountingHostStore()):  # as the plan and the peak's measure count offloaded activations
            trainer.train()
    return clock.seconds


def run_case(name: str, rounds: int, steps: int, top: int) -> dict:
    from memory_plan_worker import measure_step

    from trl_longrm.memory_plan.search import Cluster, search

    stage, config, shape, method, gib, dtype, *rows_per_step = cases()[name]
    started = time.perf_counter()
    result = search(stage, config, shape, Cluster.parse("1xcpu", device_memory_gib=gib), methods=(method,),
                    device="cpu", dtype=dtype, rows_per_step=rows_per_step[0] if rows_per_step else None)  # fmt: skip
    search_s = time.perf_counter() - started
    print(result.table(), flush=True)
    chosen = result.proposals[:top]
    planner = result.planner
    rows = []
    for candidate in chosen:
        args = planner.args(candidate.method, candidate.layout, candidate.activations, candidate.batching)
        peft = planner.peft_configs[candidate.method]
        measured = measure_step(stage, args, config, shape, peft, dtype, candidate.batching.rows, with_stack=False)
        settings = candidate.activations.describe() + (f", {candidate.batching.describe()} groups"
                                                       if rows_per_step else "")  # fmt: skip
        rows.append({"settings": settings, "planned_gib": candidate.peak_bytes / GIB,
                     "measured_gib": measured / GIB, "plan_error": candidate.peak_bytes / measured - 1,
                     "under_card": measured <= gib * GIB, "estimated_step_s": candidate.step_seconds,
                     "cpu_step_s": []})  # fmt: skip
    # Side by side: each round runs every proposal's steps in turn; a proposal's time is its median step over the
    # rounds (each run's first step, which builds the optimizer's states, left out).
    for _ in range(rounds):
        for row, candidate in zip(rows, chosen, strict=True):
            args = planner.args(candidate.method, candidate.layout, candidate.activations, candidate.batching)
            seconds = timed_steps(stage, args, config, shape, planner.peft_configs[candidate.method], dtype, steps + 1)
            row["cpu_step_s"] += seconds[1:]
    for row in rows:
        row["cpu_median_s"] = statistics.median(row["cpu_step_s"])
    return {"stage": stage, "method": method, "card_gib": gib, "shape": shape.__dict__ if hasattr(shape, "__dict__")
            else str(shape), "search_s": round(search_s, 1), "proposals": rows}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the results.")
    parser.add_argument("--cases", nargs="+", default=None, help="Cases to run (default: all).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of side-by-side timing.")
    parser.add_argument("--steps", type=int, default=3, help="Timed steps per proposal and round.")
    parser.add_argument("--top", type=int, default=3, help="Proposals compared (the fastest first).")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    model = json.loads((ROOT / "bench/results/step_time_model.json").read_text())
    error = model["leave_one_out_mean_abs_rel_error"]
    results = {}
    for name in args.cases or list(cases()):
        case = run_case(name, args.rounds, args.steps, args.top)
        first, *others = case["proposals"]
        case["top_within_error"] = all(
            first["cpu_median_s"] <= (1 + error) * other["cpu_median_s"] for other in others
        )
        results[name] = case
        print(f"| {name} | planned GiB | measured GiB | plan error | estimated s (GPU rates) | CPU median s |")
        print("|---|---|---|---|---|---|")
        for row in case["proposals"]:
            print(f"| {row['settings']} | {row['planned_gib']:.3f} | {row['measured_gib']:.3f} | "
                  f"{100 * row['plan_error']:+.2f}% | {row['estimated_step_s']:.4f} | {row['cpu_median_s']:.3f} |")  # fmt: skip
        print(f"top proposal within the model's error ({100 * error:.1f}%) of the next: {case['top_within_error']}",
              flush=True)  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"commit": commit, "stated_error": error, "threads": int(os.environ.get("OMP_NUM_THREADS") or 0) or None,
           "cases": results}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
