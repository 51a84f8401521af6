"""The memory plan of a recipe, for `trl-longrm train RECIPE --dry_run`: the model shape, group shape, ranks and
distribution (DDP or ZeRO stage) read from the recipe and its accelerate config, traced by `plan_memory`."""

from __future__ import annotations

from pathlib import Path

import yaml

from trl_longrm.memory_plan.plan import GIB, load_model_config, plan_memory
from trl_longrm.memory_plan.trace import GroupShape


def model_config_path(script_args, model_args, recipe_dir: Path | None = None) -> Path | None:
    """The `config.json` a plan reads: the recipe's `model_config` (relative to the working directory, else to the
    recipe's folder), else the local model folder's; None where neither exists (a Hub name is never downloaded)."""
    if script_args.model_config:
        path = Path(script_args.model_config).expanduser()
        if not path.exists() and recipe_dir is not None and (recipe_dir / path).exists():
            path = recipe_dir / path
        return path
    model = Path(model_args.model_name_or_path or "").expanduser()
    if (model / "config.json").is_file():
        return model / "config.json"
    return None


def distribution(script_args, world_size: int) -> tuple[str, str]:
    """`(distributed, device)` of the run: 'single', 'ddp', 'zero2' or 'zero3', and 'cuda' or 'cpu', from the accelerate
    config the recipe launches with."""
    from trl_longrm.cli import find_accelerate_config

    settings = {}
    if script_args.accelerate_config:
        with open(find_accelerate_config(str(script_args.accelerate_config)), encoding="utf-8") as handle:
            settings = yaml.safe_load(handle) or {}
    device = "cpu" if settings.get("use_cpu") else "cuda"
    if settings.get("distributed_type") == "DEEPSPEED":
        stage = int((settings.get("deepspeed_config") or {}).get("zero_stage", 2))
        if stage not in (2, 3):
            raise ValueError(f"The memory plan covers ZeRO stages 2 and 3, not {stage}.")
        return f"zero{stage}", device
    return ("single" if world_size == 1 else "ddp"), device


def group_shape(script_args, training_args, stage: str) -> GroupShape:
    """The planned group: `plan_prompt_tokens` (default: what `max_length` leaves beside the longest response),
    `plan_response_tokens` and `plan_num_rejected`; an SFT example is `max_length` tokens of which the response's."""
    response = script_args.plan_response_tokens
    prompt = script_args.plan_prompt_tokens
    if prompt is None:
        prompt = training_args.max_length - response
    return GroupShape(prompt, response, 0 if stage == "sft" else script_args.plan_num_rejected)


def recipe_memory_plans(script_args, training_args, model_args, world_size: int, recipe_dir: Path | None = None):
    """The plans of the first and last rank of the first sequence-parallel group (rank 0 holds the row's head, the
    last rank its responses and scored positions), or a note saying why there is none."""
    from trl_longrm.train import peft_config_for

    stage = script_args.stage
    path = model_config_path(script_args, model_args, recipe_dir)
    if path is None:
        return None, (
            f"no memory plan: model_name_or_path={model_args.model_name_or_path!r} is not a local model folder; name "
            "its config.json in `model_config` (bench/configs/ holds Qwen3-8B's and Llama-3.1-8B's)"
        )
    if model_args.load_in_4bit or model_args.load_in_8bit:
        return None, "no memory plan: quantised (4/8-bit) weights are not traced yet"
    config = load_model_config(path)
    distributed, device = distribution(script_args, world_size)
    shape = group_shape(script_args, training_args, stage)
    dtype = None
    if model_args.dtype not in (None, "auto"):
        import torch

        dtype = getattr(torch, model_args.dtype)
    sp = getattr(training_args, "sequence_parallel_size", 1) or 1
    ranks = sorted({0, sp - 1})
    plans = [
        plan_memory(stage, training_args, config, shape, peft_config=peft_config_for(stage, model_args), dtype=dtype,
                    world_size=world_size, rank=rank, distributed=distributed, device=device)  # fmt: skip
        for rank in ranks
    ]
    device_bytes = int(script_args.device_memory_gib * GIB)
    summary = {
        "model_config": str(path),
        "device_memory_gib": script_args.device_memory_gib,
        "group": plans[0].group,
        "peak_gib": round(max(p.peak for p in plans) / GIB, 2),
        "fits": all(p.fits(device_bytes) for p in plans),
        "ranks": [p.to_dict() for p in plans],
    }
    verdict = "fits" if summary["fits"] else "does NOT fit"
    last = (
        f"peak of the traced ranks {summary['peak_gib']:.2f} GiB: {verdict} {script_args.device_memory_gib:g} GiB per "
        f"device ({distributed}, {world_size} processes, groups of {shape.prompt_tokens:,} prompt tokens + "
        f"{1 + shape.num_rejected if stage != 'sft' else 1} x {shape.response_tokens:,})"
    )
    return summary, "\n".join([*(p.describe(device_bytes) for p in plans), last])
