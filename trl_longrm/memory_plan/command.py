"""`trl-longrm plan`: the settings that fit a model, a stage and a data shape on the user's GPUs, ranked by their
estimated speed (`trl_longrm.memory_plan.search`), printed as a table; `--write` saves the fastest as a recipe whose
`--dry_run` confirms it.

    trl-longrm plan --model qwen3-8b --stage simpo_grm --prompt_tokens 1046528 --cards 8xh100-80gb
    trl-longrm plan --model llama-3.1-8b --stage simpo_disrm --prompt_tokens 32768 --cards 1xh200 --methods lora \\
        --write disrm_h200.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from trl_longrm.memory_plan.shapes import bundled_shapes, model_config_file


GIB = 2**30
STAGES = ("sft", "simpo_grm", "simpo_disrm")
METHODS = ("lora", "full")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="The model: its config.json, a checkpoint folder holding one, or a shape bundled "
                             f"with the package by name ({', '.join(bundled_shapes())}).")
    parser.add_argument("--stage", required=True, choices=STAGES, help="The training stage.")
    parser.add_argument("--prompt_tokens", type=int, required=True, help="Tokens of a group's prompt (SFT: of an "
                        "example less its response).")  # fmt: skip
    parser.add_argument("--response_tokens", type=int, default=2048, help="Tokens of each response. Default 2048.")
    parser.add_argument("--num_rejected", type=int, default=4,
                        help="Rejected responses per group (GRM, DisRM; LongRM's data has 4). Default 4.")
    parser.add_argument("--rows_per_step", type=int, default=None,
                        help="Groups (SFT: examples) an optimizer step takes over all the GPUs, the global batch: "
                             "the search splits them into rows a micro-batch and accumulation. Default: one a "
                             "data-parallel replica, unaccumulated.")
    parser.add_argument("--cards", required=True, help="GPUs per machine and their kind: 8xh100-80gb, 1xh200, ...")
    parser.add_argument("--nodes", type=int, default=1, help="Machines. Default 1.")
    parser.add_argument("--device_memory_gib", type=float, default=None,
                        help="Memory a process gets on one card (`torch.cuda.mem_get_info()[1]`), for a card not "
                             "measured here, or a smaller one to emulate.")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="Plan GPU runs (default), or CPU runs (what a CPU run allocates; with --device_memory_gib "
                             "as the cap).")
    parser.add_argument("--host_memory_gib", type=float, default=None,
                        help="Host memory per machine: layouts that offload more are rejected. Default: not checked.")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="What training may use, comma-separated: lora, full. Default lora,full.")
    parser.add_argument("--lora_r", type=int, default=None, help="LoRA rank (default: the recipes', 8 DisRM, 16 else).")
    parser.add_argument("--margin", type=float, default=0.03,
                        help="Share of the card a proposal leaves free (the plan is within 2%% of measured peaks). "
                             "Default 0.03.")
    parser.add_argument("--top", type=int, default=5, help="Proposals shown. Default 5.")
    parser.add_argument("--longest", action="store_true",
                        help="Also the longest prompt the fastest proposal's settings fit (traced plans).")
    parser.add_argument("--write", default=None, metavar="RECIPE.yaml",
                        help="Write the fastest proposal as a recipe (`trl-longrm train RECIPE.yaml --dry_run` checks it).")
    parser.add_argument("--recipe", default=None,
                        help="With --write: a recipe whose other keys (data, optimizer, output) the written one keeps.")
    parser.add_argument("--processes", type=int, default=None,
                        help="Processes tracing at once (a plan's two traces side by side). Default: 2 where this "
                             "process may use 2 cores or more, else 1.")
    parser.add_argument("--json", action="store_true", help="Print the result as JSON instead of a table.")


def resolve_model_config(model: str) -> Path:
    """The config.json `--model` names (one message naming it where there is none)."""
    path = model_config_file(model)
    if not path.is_file():
        raise SystemExit(f"trl-longrm plan: --model {model!r}: no config.json there (give a config.json, a checkpoint "
                         f"folder holding one, or a bundled shape: {', '.join(bundled_shapes())}).")  # fmt: skip
    return path


def accelerate_config_of(layout, nodes: int, device: str = "cuda") -> str:
    """The bundled accelerate config (accelerate_configs/) of a layout."""
    if device == "cpu":
        return {"single": "cpu_single.yaml", "ddp": "cpu_ddp.yaml", "zero2": "cpu_zero2.yaml",
                "zero3": "cpu_zero3.yaml"}[layout.distributed]  # fmt: skip
    if layout.distributed == "single":
        return "single_gpu.yaml"
    if layout.offload:
        return "zero3_offload.yaml"
    name = {"ddp": "multi_gpu.yaml", "zero2": "zero2.yaml", "zero3": "zero3.yaml"}[layout.distributed]
    if nodes > 1:
        name = {"multi_gpu.yaml": "multi_node_ddp.yaml"}.get(name, f"multi_node_{name}")
    return name


def recipe_of(result, candidate, model_config: Path, lora_r: int, base: dict | None) -> dict:
    """A recipe (as a dict) training `candidate`'s settings: `base`'s other keys, or placeholders for the data."""
    import torch

    recipe = dict(base or {})
    # The model itself where the config lies in a checkpoint (its weights beside it); else the user names it.
    has_weights = any(model_config.parent.glob("*.safetensors")) or any(model_config.parent.glob("*.bin"))
    recipe.setdefault("model_name_or_path", str(model_config.parent) if has_weights else "REPLACE/with/your/model")
    recipe.setdefault("dataset_name", "REPLACE/with/your/dataset")
    recipe.setdefault("output_dir", f"outputs/{result.stage}")
    recipe.update(
        stage=result.stage,
        accelerate_config=accelerate_config_of(candidate.layout, result.cluster.nodes, result.planner.device),
        num_processes=result.cluster.world_size, model_config=str(model_config.resolve()), dtype="bfloat16",
        bf16=True, max_length=result.shape.tokens(True, result.stage), plan_prompt_tokens=result.shape.prompt_tokens,
        plan_response_tokens=result.shape.response_tokens,
        plan_device=result.cluster.card,
    )  # fmt: skip
    if result.stage != "sft":
        recipe["plan_num_rejected"] = result.shape.num_rejected
    if result.planner.device == "cpu":
        recipe.update(use_cpu=True, bf16=result.planner.dtype == torch.bfloat16)
    if result.cluster.card not in ("h100-80gb", "h200"):
        recipe.pop("plan_device")
        recipe["device_memory_gib"] = round(result.cluster.device_bytes / GIB, 3)
    recipe.update({k: v for k, v in candidate.overrides(result.stage, lora_r).items() if v is not None})
    if candidate.activations.tile_tokens is None:
        recipe.pop("mlp_tile_tokens", None)
    return recipe


def write_recipe(path: str, recipe: dict, header: str) -> None:
    import yaml

    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(recipe, sort_keys=False)
    Path(path).write_text(text, encoding="utf-8")


def rows_per_step_of(given: int | None, base: dict | None, world_size: int) -> tuple[int | None, str]:
    """The rows per step the search splits: `--rows_per_step`, else the global batch of the `--recipe` base where it
    sets one (`per_device_train_batch_size` x `gradient_accumulation_steps` x its data-parallel replicas, as
    `accelerate launch` runs it on these cards), else None (one a replica); and a note saying where it came from."""
    if given is not None:
        if given < 1:
            raise SystemExit(f"trl-longrm plan: --rows_per_step {given}: at least 1.")
        return given, ""
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps")
    if not base or not any(key in base for key in keys):
        return None, ""
    sp = int(base.get("sequence_parallel_size") or 1)
    if sp < 1 or world_size % sp:
        raise SystemExit(f"trl-longrm plan: --recipe: sequence_parallel_size {sp} does not divide the "
                         f"{world_size} GPUs; give --rows_per_step.")  # fmt: skip
    rows = int(base.get(keys[0], 1)) * int(base.get(keys[1], 1)) * (world_size // sp)
    return rows, (f"rows per step: {rows}, the global batch of --recipe ({' x '.join(f'{k} {base.get(k, 1)}' for k in keys)}"
                  f" x {world_size // sp} data-parallel replicas); --rows_per_step sets another")  # fmt: skip


def run_plan(args: argparse.Namespace) -> int:
    from trl_longrm.memory_plan.recipe import quiet_trace
    from trl_longrm.memory_plan.search import Cluster, default_lora_r, longest_prompt, search
    from trl_longrm.memory_plan.trace import GroupShape

    config_path = resolve_model_config(args.model)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"trl-longrm plan: --methods {args.methods!r}: each of {', '.join(METHODS)}.")
    try:
        cluster = Cluster.parse(args.cards, args.nodes, args.device_memory_gib, args.host_memory_gib)
    except ValueError as error:
        raise SystemExit(f"trl-longrm plan: {error}") from None
    base = None
    if args.recipe:
        import yaml

        base = yaml.safe_load(Path(args.recipe).read_text(encoding="utf-8")) or {}
    rows_per_step, note = rows_per_step_of(args.rows_per_step, base, cluster.world_size)
    if note:
        print(note, file=sys.stderr)
    shape = GroupShape(args.prompt_tokens, args.response_tokens, 0 if args.stage == "sft" else args.num_rejected)
    lora_r = args.lora_r or default_lora_r(args.stage)
    with quiet_trace():  # what the traced steps print (their logs, progress bars, warnings of a fake run)
        result = search(args.stage, config_path, shape, cluster, methods=methods, lora_r=lora_r, margin=args.margin,
                        device=args.device, processes=args.processes, rows_per_step=rows_per_step,
                        progress=lambda message: print(f"  planning {message}", file=sys.stderr, flush=True))  # fmt: skip
        longest = None
        if args.longest and result.proposals:
            longest = longest_prompt(result, result.proposals[0])["prompt_tokens"]
    if args.json:
        print(json.dumps({
            "stage": result.stage, "cluster": dataclasses.asdict(result.cluster), "group": dataclasses.asdict(result.shape),
            "rows_per_step": result.rows_per_step,
            "proposals": [_as_dict(c) for c in result.proposals[: args.top]],
            "rejected": [_as_dict(c) for c in result.rejected], "traces": result.traces, "seconds": result.seconds,
            **({"longest_prompt_tokens": longest} if longest is not None else {}),
        }, indent=1))  # fmt: skip
    else:
        print(result.table(args.top))
        if longest is not None:
            print(f"longest prompt the fastest proposal fits: {longest:,} tokens")
    if args.write:
        if not result.proposals:
            print("trl-longrm plan: nothing fits: no recipe written.", file=sys.stderr)
            return 1
        best = result.proposals[0]
        recipe = recipe_of(result, best, config_path, lora_r, base)
        header = (f"coding: trl_longrm -- written by `trl-longrm plan` ({' '.join(sys.argv[1:]) or 'plan'})\n"
                  f"The fastest proposal: {best.method}, {best.layout.describe()}, {best.activations.describe()}, "
                  f"{best.batching.rows} group(s) a micro-batch x {best.batching.accumulation} accumulated; "
                  f"planned peak {best.peak_bytes / GIB:.2f} GiB, estimated step {best.step_seconds:.2f} s.\n"
                  f"`trl-longrm train {args.write} --dry_run` prints its memory plan.")  # fmt: skip
        write_recipe(args.write, recipe, header)
        print(f"wrote {args.write}")
    return 0 if result.proposals else 1


def _as_dict(candidate) -> dict:
    return {"method": candidate.method, "layout": dataclasses.asdict(candidate.layout),
            "settings": candidate.activations.describe(), "batching": dataclasses.asdict(candidate.batching),
            "peak_gib": round(candidate.peak_bytes / GIB, 2),
            "host_gib_per_node": round(candidate.host_bytes_per_node / GIB, 2), "fits": candidate.fits,
            "step_seconds": candidate.step_seconds, "tokens_per_s": candidate.tokens_per_s,
            "computed_tokens_per_s": candidate.computed_tokens_per_s, "reason": candidate.reason,
            "estimated": candidate.estimated}  # fmt: skip


__all__ = ["add_plan_arguments", "run_plan"]
