"""The memory plan (`trl_longrm.memory_plan`, device 'cuda') next to the peaks a GPU measured for the same runs: every
attempt of a `gpu_longest_row.py` report (`bench/results/gpu/gpu.json`), ours and stock TRL, planned here on CPU.

What is compared: the run's `torch.cuda.max_memory_allocated()` less the allocation after the model was built (the
report's `peak_mem_bytes`), against the plan's peak tensor bytes less its weights; the plan's CUDA constants (context,
allocator fragmentation) are not in `max_memory_allocated` and are left out. An attempt that ran out of memory is
checked the other way: the plan must say it does not fit (its full peak over the device's memory).

    python bench/gpu_plan_vs_measured.py --report bench/results/gpu/gpu.json --out bench/results/gpu/plan_vs_measured.json
    python bench/gpu_plan_vs_measured.py --longest --out bench/results/gpu/plan_longest_long_rows.json
    python bench/gpu_plan_vs_measured.py --longest --report bench/results/gpu/long_rows_16gib.json \
        --out bench/results/gpu/plan_longest_long_rows_16gib.json      # the report's cap and kernels
    python bench/gpu_plan_vs_measured.py --longest --report bench/results/gpu/long_rows_557k.json --attention cudnn \
        --out bench/results/gpu/plan_longest_long_rows_cudnn.json

Each run is planned with the attention kernels it recorded (flash-attn's allocations for torch's `varlen_attn`,
cuDNN's fused attention where the run took it). A report of one-step runs is compared with the plan's first step:
the optimizer's states do not exist before the first optimizer step, so its forward/backward peak is the plan's
(a steady step's) less those states.

A report whose GPU was capped (`gpu_longest_row.py --memory-cap-gib`: the caching allocator may hold no more) is
planned for that cap: a run fits when the plan's peak less the CUDA context (outside the allocator) is within it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from gpu_longest_row import VARIANTS, lora_config, model_shape, run_settings  # noqa: E402


STAGES = {"grm": "simpo_grm", "disrm": "simpo_disrm"}


def model_config_of(record: dict):
    """The config of the model a record's run trained (`gpu_longest_row.py --model`: Qwen3-0.6B's shape by default)."""
    from trl_longrm.testing_utils import build_chat_tokenizer, tiny_config

    arch, shape = model_shape(record.get("model", "qwen3-0.6b"))
    shape.update({"num_hidden_layers": record["num_hidden_layers"]} if record.get("num_hidden_layers") else {})
    return tiny_config(arch, build_chat_tokenizer(), **shape)


def training_args(trainer: str, impl: str, max_length: int, long_rows: bool = False, variant: str = "default",
                  unchecked_layers: int | None = None, without_liger: bool = False):
    """The arguments `common.build_trainer` gives the run (bf16 on the GPU; `long_rows`: checkpoint offload and the
    tiled MLP; `variant`: `gpu_longest_row.VARIANTS`' settings, its unchecked layers `unchecked_layers`), as a config
    object the plan reads. `without_liger`: Liger's kernels left out (its Triton kernels do not run on the plan's fake
    tensors)."""
    settings = run_settings(long_rows, variant, unchecked_layers)
    if without_liger:
        settings.pop("use_liger_kernel", None)
    args = common.base_args("/tmp/plan", 2, max_length=max_length, bf16=True, **settings)
    if impl == "ours":
        from trl_longrm import SimPODisRMConfig, SimPOGRMConfig

        return SimPOGRMConfig(nll_loss_weight=0.0, **args) if trainer == "grm" else SimPODisRMConfig(**args)
    if trainer == "grm":
        from trl.experimental.cpo import CPOConfig

        return CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.5, simpo_gamma=0.5, remove_unused_columns=False,
                         **args)  # fmt: skip
    from trl import RewardConfig

    return RewardConfig(**args)


def attention_of(record: dict, report: dict | None = None) -> str:
    """The attention kernels a run took (its record's `kernels`; a run that ran out of memory recorded none: those
    of the report's other runs)."""
    records = [record, *(report or {}).get("long_rows", []), *(report or {}).get("throughput", [])]
    for r in records:
        if r.get("kernels"):
            return "cudnn" if any("torch_cudnn" in k for k in r["kernels"]) else "flash_attn"
    return "flash_attn"


def report_steps(report: dict) -> int:
    """Steps per attempt of a report whose records do not say (`--steps` of its last command; the default 3)."""
    words = report.get("command", "").split()
    for i, word in enumerate(words):
        if word.startswith("--steps="):
            return int(word.split("=", 1)[1])
        if word == "--steps" and i + 1 < len(words):
            return int(words[i + 1])
    return 3


def plan_attempt(record: dict, response_length: int, model_config=None, attention: str = "flash_attn",
                 first_step: bool = False) -> dict:
    """The plan of a run: its tensors beyond the weights (`planned_bytes`, what `peak_mem_bytes` measures) and its
    full peak (`planned_total_bytes`, what must fit the device). `first_step`: of a run's first step (no optimizer
    states before its optimizer step: they, and the fragmentation allowance on them, are taken off a
    forward/backward peak). `model_config`: default, the record's model (`model_config_of`). A LoRA run
    (`lora_r`) measures from the base model built: the adapter's weights are among what it measures."""
    import torch

    from trl_longrm.memory_plan import GroupShape, plan_memory
    from trl_longrm.memory_plan.plan import CUDA_FRAGMENTATION_FRACTION

    trainer, impl, k = record["trainer"], record["impl"], record.get("num_rejected", 1)
    shape = GroupShape(record["prompt_length"], response_length, k)
    # k > 1: the run's max_length is its whole group's (`common.build_trainer`: nothing truncated)
    max_length = (record["prompt_length"] + response_length) * (k if k == 1 else k + 1)
    args = training_args(trainer, impl, max_length, bool(record.get("long_rows")), record.get("variant", "default"),
                         record.get("unchecked_layers"))
    lora_r = record.get("lora_r", 0)
    plan = plan_memory(STAGES[trainer], args, model_config or model_config_of(record), shape, dtype=torch.bfloat16,
                       device="cuda", stock=impl == "stock", attention=attention,
                       peft_config=lora_config(trainer, lora_r))  # fmt: skip
    tensors = plan.peak - sum(plan.extra.values())
    states = plan.optimizer_states if first_step and plan.peak_phase == "forward/backward" else 0
    base_weights = plan.weights - (plan.trainable_weights if lora_r else 0)
    return {"attention": attention, "peak_phase": plan.peak_phase,
            **({"first_step": True, "optimizer_states_bytes": plan.optimizer_states} if first_step else {}),
            "planned_bytes": tensors - base_weights - states,
            "planned_total_bytes": plan.peak - int(states * (1 + CUDA_FRAGMENTATION_FRACTION)),
            "plan_seconds": plan.trace_seconds}  # fmt: skip


def device_bytes_of(report: dict, memory_cap_gib: float | None = None) -> int:
    """What the plan's full peak is compared with: the GPU's memory, or under a cap on the caching allocator the cap
    plus the CUDA context the plan counts (the context is not the allocator's)."""
    from trl_longrm.memory_plan.plan import CUDA_CONTEXT_BYTES

    cap = memory_cap_gib if memory_cap_gib is not None else report.get("memory_cap_gib")
    if cap is None:
        return int(report["gpu_memory_gib"] * 2**30)
    return int(cap * 2**30) + CUDA_CONTEXT_BYTES


def plan_longest(trainer: str, long_rows: bool, response_length: int, model_config, device_bytes: int,
                 start: int = 65536, granularity: int = 8192, attention: str = "flash_attn") -> dict:
    """The longest prompt (a multiple of `granularity`) of ours at k = 1 whose planned peak fits `device_bytes`:
    doubling from `start`, then bisection; every plan tried is listed."""
    tried = []

    def fits(length):
        record = {"trainer": trainer, "impl": "ours", "prompt_length": length, "long_rows": long_rows}
        plan = plan_attempt(record, response_length, model_config, attention)
        tried.append({"prompt_length": length, "planned_total_bytes": plan["planned_total_bytes"]})
        print(json.dumps({**record, **tried[-1]}), flush=True)
        return plan["planned_total_bytes"] <= device_bytes

    lo, hi = 0, start
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"trainer": trainer, "long_rows": long_rows, "attention": attention, "longest_prompt_length": lo,
            "first_failing": hi, "plans": tried}


def propose_unchecked(model: str, trainer: str, lora_r: int, num_rejected: int, prompt_length: int,
                      response_length: int, variant: str, device: str = "h200") -> dict:
    """The memory plan's proposal of `unchecked_layers` for a `gpu_longest_row.py` run of ours (`largest_unchecked_layers`
    on `device`, cuDNN's attention as 'auto' takes it there), planned without Liger's kernels (which keep less)."""
    import torch

    from trl_longrm.memory_plan import GroupShape
    from trl_longrm.memory_plan.devices import device_memory_bytes
    from trl_longrm.memory_plan.propose import DEFAULT_MARGIN, largest_unchecked_layers

    shape_record = {"model": model}
    k = num_rejected
    max_length = (prompt_length + response_length) * (k if k == 1 else k + 1)
    args = training_args(trainer, "ours", max_length, variant=variant, unchecked_layers=0, without_liger=True)
    card = device_memory_bytes(device)
    layers, plan = largest_unchecked_layers(STAGES[trainer], args, model_config_of(shape_record),
                                            GroupShape(prompt_length, response_length, k), card,
                                            dtype=torch.bfloat16, device="cuda", attention="cudnn",
                                            peft_config=lora_config(trainer, lora_r))  # fmt: skip
    return {"model": model, "trainer": trainer, "lora_r": lora_r, "num_rejected": k, "prompt_length": prompt_length,
            "response_length": response_length, "variant": variant, "device": device, "device_bytes": card,
            "margin": DEFAULT_MARGIN, "unchecked_layers": layers,
            "num_hidden_layers": model_config_of(shape_record).num_hidden_layers, "planned_peak_bytes": plan.peak,
            "planned_peak_gib": round(plan.peak / 2**30, 2), "not_planned": "Liger's kernels (they keep less)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", default=str(HERE / "results" / "gpu" / "gpu.json"))
    parser.add_argument("--response-length", type=int, default=256, help="The report's longest response.")
    parser.add_argument("--out", default=str(HERE / "results" / "gpu" / "plan_vs_measured.json"))
    parser.add_argument("--longest", action="store_true",
                        help="Instead: the longest prompt the plan fits on the report's GPU for ours' GRM (k = 1) "
                             "without and with the long-row settings (checkpoint offload, tiled MLP).")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="With --longest: plan for the report's GPU with its caching allocator capped at this "
                             "(as `gpu_longest_row.py --memory-cap-gib` runs it).")
    parser.add_argument("--start", type=int, default=65536, help="With --longest: the first prompt length planned.")
    parser.add_argument("--attention", choices=("flash_attn", "cudnn"), default=None,
                        help="The attention kernels planned (default: those the report's runs recorded).")
    parser.add_argument("--propose-unchecked", nargs=6, action="append", default=[],
                        metavar=("MODEL", "TRAINER", "LORA_R", "K", "PROMPT", "VARIANT"),
                        help="The unchecked layers the plan proposes for such a run on an H200 (repeatable); writes "
                             "--out and prints each as `--unchecked-layers` takes it.")
    cli = parser.parse_args()

    if cli.propose_unchecked:
        rows = []
        for model, trainer, lora_r, k, prompt, variant in cli.propose_unchecked:
            rows.append(propose_unchecked(model, trainer, int(lora_r), int(k), int(prompt), cli.response_length,
                                          variant))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        Path(cli.out).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "proposals": rows},
                                            indent=1) + "\n")  # fmt: skip
        return

    report = json.loads(Path(cli.report).read_text())
    device_bytes = device_bytes_of(report, cli.memory_cap_gib if cli.longest else None)
    model_config = model_config_of({})
    if cli.longest:
        attention = cli.attention or attention_of({}, report)
        rows = [plan_longest("grm", long_rows, cli.response_length, model_config, device_bytes, start=cli.start,
                             attention=attention) for long_rows in (False, True)]  # fmt: skip
        result = {"command": " ".join(["python", *sys.argv]), "gpu": report["gpu"], "device_bytes": device_bytes,
                  **({"memory_cap_gib": cli.memory_cap_gib} if cli.memory_cap_gib is not None else {}),
                  "longest": rows}  # fmt: skip
        Path(cli.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps([{k: v for k, v in r.items() if k != "plans"} for r in rows]))
        return
    attempts = [*report["throughput"], *(a for row in report["longest_row"] for a in row["attempts"]),
                *report.get("long_rows", [])]
    seen, rows = set(), []
    for record in attempts:
        key = (record["trainer"], record["impl"], record["prompt_length"], record.get("num_rejected", 1),
               bool(record.get("long_rows")), record.get("variant", "default"), record.get("model", "qwen3-0.6b"),
               record.get("lora_r", 0), record.get("num_hidden_layers"))
        if key in seen or record["status"] not in ("ok", "oom"):
            continue
        seen.add(key)
        if VARIANTS[key[5]].get("use_liger_kernel"):
            # Liger's Triton kernels do not run on the plan's fake tensors: such a run is not planned.
            rows.append({"trainer": key[0], "prompt_length": key[2], "variant": key[5], "not_planned": "Liger"})
            continue
        row = {"trainer": key[0], "impl": key[1], "prompt_length": key[2], "num_rejected": key[3],
               "long_rows": key[4], **({"variant": key[5]} if key[5] != "default" else {}),
               **({"model": key[6]} if key[6] != "qwen3-0.6b" else {}), **({"lora_r": key[7]} if key[7] else {}),
               **({"num_hidden_layers": key[8]} if key[8] else {}),
               "status": record["status"], "measured_bytes": record.get("peak_mem_bytes"),
               **plan_attempt(record, cli.response_length, model_config_of(record),
                              cli.attention or attention_of(record, report),
                              first_step=record.get("steps", report_steps(report)) == 1)}  # fmt: skip
        if record["status"] == "ok":
            row["rel_error"] = row["planned_bytes"] / row["measured_bytes"] - 1
        else:
            row["plan_says_oom"] = row["planned_total_bytes"] > device_bytes
        rows.append(row)
        print(json.dumps(row), flush=True)
    errors = [abs(r["rel_error"]) for r in rows if "rel_error" in r]
    result = {
        "command": " ".join(["python", *sys.argv]),
        "report": cli.report,
        "gpu": report["gpu"],
        **({"memory_cap_gib": report["memory_cap_gib"]} if report.get("memory_cap_gib") is not None else {}),
        "rows": rows,
        "max_abs_rel_error": max(errors) if errors else None,
        "ooms_predicted": sum(bool(r.get("plan_says_oom")) for r in rows),
        "ooms_measured": sum(r.get("status") == "oom" for r in rows),
    }
    Path(cli.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
