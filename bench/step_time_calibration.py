"""Fit the step-time model's coefficients (`trl_longrm.memory_plan.step_time`) on the runs measured on GPUs, and
report each run's error when predicted by a fit without it (leave-one-out).

The runs: every timed run of ours in the `gpu_longest_row.py` reports under bench/results/gpu/ (Qwen3-0.6B's shape on
an H100 and an H200, the 8B shapes through LoRA on an H200; by default and with the levers; k = 1 and 4; 8K-131K
prompts; the long-row settings). A run's measured step is the median of its timed steps. Its model terms come from its
record: the model's shape, its trainer, prompt, k and responses (the benchmark's seeded groups, rebuilt), the
variant's settings, and the attention kernel it recorded. The fit is a non-negative least squares on the relative
error (each run weighs the same), over the matmul, attention and elementwise terms and a constant per step; offload
is added at the host link's rate as it is.

    python bench/step_time_calibration.py --out bench/results/step_time_model.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from gpu_longest_row import model_shape, run_settings  # noqa: E402


REPORTS = [
    "gpu/gpu.json", "gpu/gpu_cudnn.json", "gpu/h200/gpu_8b.json", "gpu/h200/gpu_8b_variants.json",
    "gpu/h200/mfu_variants.json", "gpu/h200/levers/gpu_8b_variants.json", "gpu/h200/levers_0_6b/gpu_levers_0_6b.json",
]  # fmt: skip
STAGES = {"grm": "simpo_grm", "disrm": "simpo_disrm"}


def card_of(gpu: str) -> str:
    return "h200" if "H200" in gpu else "h100-80gb"


def measured_seconds(record: dict) -> float | None:
    """The median of a run's timed steps (the first is never timed; a profiled last step of 3+ neither)."""
    times = record.get("step_seconds") or []
    if record.get("timed_steps"):
        first, last = record["timed_steps"]
        times = times[first - 1 : last]
    else:
        times = times[1:]
    return statistics.median(times) if times else None


def runs() -> list[dict]:
    """Every timed run of ours in `REPORTS`, with what the model needs: card, config, stage, shape, settings."""
    from trl_longrm.memory_plan import GroupShape
    from trl_longrm.memory_plan.step_time import settings_of
    from trl_longrm.testing_utils import build_chat_tokenizer, tiny_config

    tokenizer = build_chat_tokenizer()
    out, seen = [], set()
    for name in REPORTS:
        report = json.loads((HERE / "results" / name).read_text())
        records = [*report["throughput"], *report.get("long_rows", []),
                   *(a for row in report.get("longest_row", []) for a in row["attempts"])]  # fmt: skip
        for r in records:
            seconds = measured_seconds(r)
            if r["impl"] != "ours" or r["status"] != "ok" or not seconds:
                continue
            model = r.get("model", "qwen3-0.6b")
            key = (name, model, r["trainer"], r["prompt_length"], r.get("num_rejected", 1), r.get("variant", "default"),
                   bool(r.get("long_rows")), r.get("lora_r", 0))
            if key in seen:
                continue
            seen.add(key)
            arch, shape = model_shape(model)
            shape.update({"num_hidden_layers": r["num_hidden_layers"]} if r.get("num_hidden_layers") else {})
            config = tiny_config(arch, tokenizer, **shape)
            k = r.get("num_rejected", 1)
            # The benchmark's groups (seeded): the timed ones' mean response length.
            groups = common.random_groups(r.get("steps", 3), r["prompt_length"], 256, tokenizer.eos_token_id,
                                          warmup_prompt_length=None, num_rejected=k, vocab_size=shape["vocab_size"])
            responses = [len(x) for g in groups[1:] for x in [g["chosen_completion_ids"], *g["rejected_completion_ids"]]]
            variant = r.get("variant", "default")
            settings = run_settings(bool(r.get("long_rows")), variant, r.get("unchecked_layers"))
            args = common.base_args("/tmp/unused", 2, max_length=8, bf16=False, **settings)
            from types import SimpleNamespace

            gc_kwargs = settings.get("gradient_checkpointing_kwargs") or {}
            namespace = SimpleNamespace(**args, activation_checkpointing=True, activation_checkpointing_kwargs=gc_kwargs,
                                        shared_prefix=r.get("shared_prefix", True), padding_free=True)
            attention = "cudnn" if any("torch_cudnn" in k_ for k_ in r.get("kernels") or []) else "flash_attn"
            out.append({
                "report": name, "model": model, "trainer": r["trainer"], "prompt_length": r["prompt_length"],
                "num_rejected": k, "variant": variant, "long_rows": bool(r.get("long_rows")), "lora_r": r.get("lora_r", 0),
                "card": card_of(report["gpu"]), "measured_seconds": seconds, "config": config,
                "stage": STAGES[r["trainer"]],
                "shape": GroupShape(r["prompt_length"], round(statistics.mean(responses)), k),
                "settings": settings_of(namespace, lora_r=r.get("lora_r", 0), attention=attention),
            })  # fmt: skip
    return out


def fit(rows: list[dict]) -> dict:
    """Non-negative least squares of the relative error over the fitted features: every subset of features is solved
    by least squares and the best one whose coefficients are all >= 0 kept (five features: 31 subsets)."""
    import torch

    from trl_longrm.memory_plan.step_time import FEATURES

    x = torch.tensor([row["features"] for row in rows], dtype=torch.float64)
    y = torch.tensor([row["target"] for row in rows], dtype=torch.float64)
    weights = 1 / torch.tensor([row["measured_seconds"] for row in rows], dtype=torch.float64)
    best = None
    for size in range(1, len(FEATURES) + 1):
        for subset in itertools.combinations(range(len(FEATURES)), size):
            a = x[:, subset] * weights[:, None]
            solution = torch.linalg.lstsq(a, y * weights).solution
            if (solution < 0).any():
                continue
            residual = float(((a @ solution - y * weights) ** 2).sum())
            if best is None or residual < best[0] - 1e-12:
                coefficients = dict.fromkeys(FEATURES, 0.0)
                coefficients.update({FEATURES[i]: float(v) for i, v in zip(subset, solution)})
                best = (residual, coefficients)
    return best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(HERE / "results" / "step_time_model.json"))
    cli = parser.parse_args()

    from trl_longrm.memory_plan.step_time import step_terms

    rows = runs()
    for row in rows:
        terms = step_terms(row["config"], row["stage"], row["shape"], row["settings"], row["card"])
        row["features"] = terms.features()
        row["fixed_seconds"] = terms.offload + terms.communication
        row["target"] = row["measured_seconds"] - row["fixed_seconds"]
    coefficients = fit(rows)

    def predict(row, c):
        return sum(c[f] * v for f, v in zip(c, row["features"])) + row["fixed_seconds"]

    published = []
    for i, row in enumerate(rows):
        others = fit(rows[:i] + rows[i + 1 :])
        published.append({
            **{k: row[k] for k in ("report", "model", "trainer", "prompt_length", "num_rejected", "variant", "long_rows",
                                   "lora_r", "card", "measured_seconds")},
            "predicted_seconds": predict(row, coefficients),
            "leave_one_out_seconds": predict(row, others),
            "leave_one_out_rel_error": predict(row, others) / row["measured_seconds"] - 1,
        })  # fmt: skip
    errors = [abs(r["leave_one_out_rel_error"]) for r in published]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    result = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit.strip(),
        "coefficients": coefficients,
        "runs": len(published),
        "leave_one_out_mean_abs_rel_error": statistics.mean(errors),
        "leave_one_out_median_abs_rel_error": statistics.median(errors),
        "leave_one_out_max_abs_rel_error": max(errors),
        "rows": published,
    }
    Path(cli.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    for r in published:
        print(f"{r['card']:10s} {r['model']:13s} {r['trainer']:5s} {r['prompt_length']:6d} k={r['num_rejected']} "
              f"{r['variant']:16s}{' long' if r['long_rows'] else '     '} measured {r['measured_seconds']:6.2f} s, "
              f"predicted {r['predicted_seconds']:6.2f}, without it {r['leave_one_out_seconds']:6.2f} "
              f"({r['leave_one_out_rel_error']:+.1%})")


if __name__ == "__main__":
    main()
