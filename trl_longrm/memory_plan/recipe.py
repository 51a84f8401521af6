"""The memory plan of a recipe, for `trl-longrm train RECIPE --dry_run`: the model shape, group shape, ranks and
distribution (DDP or ZeRO stage) read from the recipe and its accelerate config, traced by `plan_memory`."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import yaml

from trl_longrm.memory_plan.devices import device_memory_bytes
from trl_longrm.memory_plan.plan import GIB, load_model_config, plan_memory
from trl_longrm.memory_plan.shapes import model_config_file
from trl_longrm.memory_plan.trace import GroupShape, fresh_args
from trl_longrm.trainers.common import uses_shared_prefix


def model_config_path(script_args, model_args, recipe_dir: Path | None = None) -> Path | None:
    """The `config.json` a plan reads: the recipe's `model_config` (relative to the working directory, else to the
    recipe's folder, else a bundled shape's name), else the local model folder's; None where neither exists (a Hub
    name is never downloaded)."""
    if script_args.model_config:
        path = Path(script_args.model_config).expanduser()
        if not path.exists() and recipe_dir is not None and (recipe_dir / path).exists():
            path = recipe_dir / path
        return path if path.exists() else model_config_file(script_args.model_config)
    model = Path(model_args.model_name_or_path or "").expanduser()
    if (model / "config.json").is_file():
        return model / "config.json"
    return None


def distribution(script_args, world_size: int) -> tuple[str, str]:
    """`(distributed, device)` of the run: 'single', 'ddp', 'zero2' or 'zero3', and 'cuda' or 'cpu', from the accelerate
    config the recipe launches with."""
    settings = _accelerate_settings(script_args)
    device = "cpu" if settings.get("use_cpu") else "cuda"
    if settings.get("distributed_type") == "DEEPSPEED":
        stage = int((settings.get("deepspeed_config") or {}).get("zero_stage", 2))
        if stage not in (2, 3):
            raise ValueError(f"The memory plan covers ZeRO stages 2 and 3, not {stage}.")
        return f"zero{stage}", device
    return ("single" if world_size == 1 else "ddp"), device


@contextlib.contextmanager
def quiet_trace():
    """What a traced step prints, silenced: the trainers' logs and progress bars, datasets' map bars, transformers'
    and accelerate's warnings about the fake run (a traced loss is 0, a metric NaN: they would read as a failed run)."""
    import datasets
    import transformers

    verbosity = transformers.logging.get_verbosity()
    bars = datasets.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def processes_per_node(script_args, world_size: int) -> int:
    """Processes on one machine: the world over the accelerate config's `num_machines` (1 without a config)."""
    machines = int(_accelerate_settings(script_args).get("num_machines") or 1)
    return max(world_size // max(machines, 1), 1)


def _accelerate_settings(script_args) -> dict:
    from trl_longrm.launch import find_accelerate_config

    if not script_args.accelerate_config:
        return {}
    with open(find_accelerate_config(str(script_args.accelerate_config)), encoding="utf-8") as handle:
        return yaml.safe_load(handle) or {}


def deepspeed_config(script_args, training_args) -> dict | None:
    """The DeepSpeed config a ZeRO run of the recipe uses: `training_args.deepspeed` where set, else the one accelerate
    builds from the accelerate YAML's `deepspeed_config` section (its `deepspeed_config_file`, or its stage and offload
    devices with DeepSpeed's defaults for the rest: `trl_longrm.memory_plan.deepspeed.accelerate_deepspeed_config`)."""
    from trl_longrm.launch import find_accelerate_config
    from trl_longrm.memory_plan.deepspeed import accelerate_deepspeed_config

    if getattr(training_args, "deepspeed", None):
        return training_args.deepspeed
    settings = _accelerate_settings(script_args)
    if settings.get("distributed_type") != "DEEPSPEED":
        return None
    base = Path(find_accelerate_config(str(script_args.accelerate_config))).parent
    return accelerate_deepspeed_config(settings.get("deepspeed_config") or {}, base)


def group_shape(script_args, training_args, stage: str) -> GroupShape:
    """The planned group: `plan_prompt_tokens` (default: what `max_length` leaves beside the longest response),
    `plan_response_tokens` and `plan_num_rejected` (at most the trainer's `num_rejected`, the responses it keeps of a
    group); an SFT example is `max_length` tokens of which the response's."""
    response = script_args.plan_response_tokens
    prompt = script_args.plan_prompt_tokens
    if prompt is None:
        prompt = training_args.max_length - response
    if stage == "sft":
        return GroupShape(prompt, response, 0)
    kept = getattr(training_args, "num_rejected", None)
    rejected = script_args.plan_num_rejected if kept is None else min(kept, script_args.plan_num_rejected)
    return GroupShape(prompt, response, rejected)


def recipe_memory_plans(script_args, training_args, model_args, world_size: int, recipe_dir: Path | None = None,
                        stock: bool = False):  # fmt: skip
    """The plans of the first and last rank of the first sequence-parallel group (rank 0 holds the row's head, the
    last rank its responses and scored positions), or a note saying why there is none.

    `stock=True`: the plan of stock TRL's trainer of the stage on the same model, group, processes and training
    arguments (`trl_longrm.memory_plan.stock`; every rank data parallel, so rank 0 stands for all)."""
    from trl_longrm.stages import peft_config_for

    stage = script_args.stage
    path = model_config_path(script_args, model_args, recipe_dir)
    if path is None:
        return None, (
            f"no memory plan: model_name_or_path={model_args.model_name_or_path!r} is not a local model folder; name "
            "its config.json in `model_config`, or a bundled shape's name (qwen3-8b, llama-3.1-8b)"
        )
    if model_args.load_in_8bit:
        return None, "no memory plan: 8-bit weights are not planned (4-bit QLoRA is)"
    config = load_model_config(path)
    distributed, device = distribution(script_args, world_size)
    zero_config = deepspeed_config(script_args, training_args) if distributed.startswith("zero") else None
    shape = group_shape(script_args, training_args, stage)
    import torch

    dtype = None
    if model_args.dtype not in (None, "auto"):
        dtype = getattr(torch, model_args.dtype)
    sp = getattr(training_args, "sequence_parallel_size", 1) or 1
    ranks = [0] if stock else sorted({0, sp - 1})
    peft_config = peft_config_for(stage, model_args)

    def plans_for(shape: GroupShape, args=training_args):
        plans = [
            plan_memory(stage, args, config, shape, peft_config=peft_config, dtype=dtype, world_size=world_size,
                        rank=rank, distributed=distributed, device=device, stock=stock,
                        load_in_4bit=bool(model_args.load_in_4bit),
                        nested_quant=bool(model_args.use_bnb_nested_quant),
                        deepspeed_config=zero_config)  # fmt: skip
            for rank in ranks
        ]
        return plans

    with quiet_trace():
        plans = plans_for(shape)
    device_bytes = device_memory_bytes(script_args.plan_device, script_args.device_memory_gib)
    device_name = script_args.plan_device if script_args.device_memory_gib is None else "device_memory_gib"
    summary = {
        "trainer": plans[0].trainer,
        "model_config": str(path),
        "plan_device": device_name,
        "device_memory_gib": round(device_bytes / GIB, 2),
        "group": plans[0].group,
        "peak_gib": round(max(p.peak for p in plans) / GIB, 2),
        "fits": all(p.fits(device_bytes) for p in plans),
        # Offloaded activations are host memory: every process of a machine holds its own (the traced ranks' most).
        "host_memory_per_node_gib": round(max(p.host_memory for p in plans) * processes_per_node(script_args, world_size)
                                          / GIB, 2),
        "ranks": [p.to_dict() for p in plans],
    }
    if script_args.plan_longest_group:
        with quiet_trace():
            summary["longest_group"] = longest_group(plans_for, training_args, stage, shape, plans, device_bytes)
    verdict = "fits" if summary["fits"] else "does NOT fit"
    last = (
        f"peak of the traced ranks {summary['peak_gib']:.2f} GiB: {verdict} {device_bytes / GIB:.2f} GiB per "
        f"device ({device_name}, {distributed}, {world_size} processes, groups of {shape.prompt_tokens:,} prompt tokens + "
        f"{1 + shape.num_rejected if stage != 'sft' else 1} x {shape.response_tokens:,})"
    )
    lines = [*(p.describe(device_bytes) for p in plans), last]
    if summary["host_memory_per_node_gib"]:
        lines.append(f"host memory per machine ({processes_per_node(script_args, world_size)} processes, offloaded "
                     f"activations): {summary['host_memory_per_node_gib']:.2f} GiB")
    if "longest_group" in summary:
        found = summary["longest_group"]
        lines.append(
            f"longest group that fits: {found['prompt_tokens']:,} prompt tokens ({found['group_tokens']:,} tokens a group, "
            f"peak {found['peak_gib']:.2f} GiB; {found['plans_traced']} plans traced)"
            if found["prompt_tokens"] else "longest group that fits: none (the shortest prompt tried does not fit)"
        )
    return summary, "\n".join(lines)


# Prompt lengths of the longest-group search are multiples of this (tokens).
SEARCH_GRANULARITY = 1024


def longest_group(plans_for, training_args, stage: str, shape: GroupShape, plans, device_bytes: int,
                  max_plans: int = 8) -> dict:  # fmt: skip
    """The longest prompt (same k, same responses, same layout) whose plan fits `device_bytes` on every traced rank.

    The peak grows about linearly with the row's tokens (activations, keys/values and heads are per token), so the
    search is a secant on `peak(prompt) - device_bytes` from the recipe's group, each step a traced plan (never a
    formula), then the fitting and the non-fitting lengths closest to the crossing are traced to bracket it within
    `SEARCH_GRANULARITY` tokens (or `max_plans` plans)."""
    step = SEARCH_GRANULARITY
    traced = {shape.prompt_tokens: max(p.peak for p in plans)}

    def peak_at(prompt: int) -> int:
        if prompt not in traced:
            group = GroupShape(prompt, shape.response_tokens, shape.num_rejected)
            longest = prompt + shape.response_tokens  # admitted without truncation
            overrides = {"max_length": longest}
            if getattr(training_args, "max_tokens_per_row", None):
                overrides["max_tokens_per_row"] = max(
                    training_args.max_tokens_per_row, group.tokens(uses_shared_prefix(training_args), stage)
                )
            traced[prompt] = max(p.peak for p in plans_for(group, fresh_args(training_args, **overrides)))
        return traced[prompt]

    a = shape.prompt_tokens
    b = max(step, (a // 2) // step * step) if a > step else 2 * step
    for _ in range(max_plans):
        fits = sorted(p for p, v in traced.items() if v <= device_bytes)
        over = sorted(p for p, v in traced.items() if v > device_bytes)
        if fits and over and over[0] - fits[-1] <= step:
            break
        fa, fb = peak_at(a) - device_bytes, peak_at(b) - device_bytes
        if fa == fb:
            guess = b + step if fb < 0 else b - step
        else:
            guess = b - fb * (b - a) / (fb - fa)
        guess = max(step, int(guess) // step * step)
        if fits and over:  # keep the guess inside the bracket, next to the side it crosses
            guess = min(max(guess, fits[-1] + step), over[0] - step) if over[0] - fits[-1] > step else fits[-1]
        if guess in traced:
            guess = guess + step if traced[guess] <= device_bytes else guess - step
            if guess in traced or guess < step:
                break
        a, b = b, guess
        peak_at(b)
    fits = sorted(p for p, v in traced.items() if v <= device_bytes)
    prompt = fits[-1] if fits else 0
    group = GroupShape(prompt, shape.response_tokens, shape.num_rejected)
    return {
        "prompt_tokens": prompt,
        "response_tokens": shape.response_tokens,
        "num_rejected": shape.num_rejected,
        "group_tokens": group.tokens(uses_shared_prefix(training_args), stage) if prompt else 0,
        "peak_gib": round(traced[prompt] / GIB, 2) if prompt else None,
        "plans_traced": len(traced),
        "traced_prompts": {str(p): round(v / GIB, 3) for p, v in sorted(traced.items())},
    }
