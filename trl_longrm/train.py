"""Run one LongRM training stage from a YAML recipe: `python -m trl_longrm recipe.yaml` (what
`accelerate launch -m trl_longrm recipe.yaml` runs on every process).

A recipe names its `stage` (`sft`, `simpo_grm` or `simpo_disrm`); the rest are fields of `LongRMScriptArguments`, of
the stage's config (`LongSFTConfig`, `SimPOGRMConfig`, `SimPODisRMConfig`) and of TRL's `ModelConfig` (model path,
dtype, LoRA and 4/8-bit quantisation). Parsing is TRL's `TrlParser`: command-line flags override recipe values, an
unknown key fails naming it, and `--help` lists every option of the stage.

Example:
```bash
python -m trl_longrm recipes/simpo_grm.yaml --learning_rate 1e-6 --dry_run
```
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from trl import ModelConfig, ScriptArguments, TrlParser


logger = logging.getLogger(__name__)

# stage -> (trainer class name, config class name, model head)
STAGES = {
    "sft": ("LongSFTTrainer", "LongSFTConfig", "causal-lm"),
    "simpo_grm": ("SimPOGRMTrainer", "SimPOGRMConfig", "causal-lm"),
    "simpo_disrm": ("SimPODisRMTrainer", "SimPODisRMConfig", "seq-cls"),
}


@dataclass
class LongRMScriptArguments(ScriptArguments):
    """Arguments of a recipe that are not the trainer's or the model's (TRL's `ScriptArguments` plus ours)."""

    stage: str | None = field(
        default=None,
        metadata={
            "help": "Training stage to run: 'sft', 'simpo_grm' or 'simpo_disrm'. Required.",
            "choices": list(STAGES),
        },
    )
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on during training. Default None: no evaluation."}
    )
    dry_run: bool = field(
        default=False,
        metadata={
            "help": "Print the resolved configuration and the plan (world size, ring groups, batch sizes, tokens "
            "per step) and exit without loading weights. Default False."
        },
    )
    accelerate_config: str | None = field(
        default=None,
        metadata={
            "help": "Accelerate config file that `trl-longrm train` launches with (a path, or a file name under "
            "accelerate_configs/). Ignored by `python -m trl_longrm`. Default None: accelerate's default."
        },
    )
    num_processes: int | None = field(
        default=None,
        metadata={"help": "Processes `trl-longrm train` launches. Default None: the accelerate config's number."},
    )
    save_merged_model: bool = field(
        default=False,
        metadata={
            "help": "With LoRA/QLoRA, also save the base model with the adapter merged into `output_dir/merged`, so "
            "the next stage can start from it as a plain model. Default False."
        },
    )


def positional_recipe_to_config(argv: list[str]) -> list[str]:
    """`recipe.yaml` as the first argument means `--config recipe.yaml` (as `accelerate launch -m` passes it)."""
    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml")):
        return ["--config", argv[0], *argv[1:]]
    return list(argv)


def _flag_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def read_recipe(argv: list[str]) -> dict:
    path = _flag_value(argv, "--config")
    if path is None:
        return {}
    with open(path, encoding="utf-8") as handle:
        recipe = yaml.safe_load(handle) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"Recipe {path} must be a YAML mapping of option names to values.")
    return recipe


def resolve_stage(argv: list[str]) -> str | None:
    stage = _flag_value(argv, "--stage") or read_recipe(argv).get("stage")
    if stage is not None and stage not in STAGES:
        raise ValueError(f"Unknown stage {stage!r}; expected one of {sorted(STAGES)}.")
    return stage


def stage_classes(stage: str):
    import trl_longrm

    trainer_name, config_name, head = STAGES[stage]
    return getattr(trl_longrm, trainer_name), getattr(trl_longrm, config_name), head


def build_parser(stage: str | None) -> TrlParser:
    if stage is None:
        return TrlParser((LongRMScriptArguments, ModelConfig))
    return TrlParser((LongRMScriptArguments, stage_classes(stage)[1], ModelConfig))


def parse_args(argv: list[str] | None = None):
    """`(script_args, training_args, model_args)` of a recipe plus command-line overrides."""
    argv = positional_recipe_to_config(sys.argv[1:] if argv is None else argv)
    stage = resolve_stage(argv)
    parser = build_parser(stage)
    if stage is None:
        if "-h" in argv or "--help" in argv:
            parser.parse_args_and_config(argv)  # prints the shared options and exits
        parser.error(f"No `stage` given: set `stage:` in the recipe or pass --stage, one of {sorted(STAGES)}.")
    if _wants_dry_run(argv) and _flag_value(argv, "--use_cpu") is None and not _has_accelerator():
        # TrainingArguments refuses bf16 without a GPU; a dry run only validates and prints, so validate as CPU.
        argv = [*argv, "--use_cpu", "true"]
    return parser.parse_args_and_config(argv)


def _wants_dry_run(argv: list[str]) -> bool:
    value = _flag_value(argv, "--dry_run") or _flag_value(argv, "--dry-run")
    flagged = any(a in ("--dry_run", "--dry-run") for a in argv)
    return flagged and (value is None or value.lower() in ("true", "1", "yes") or value.startswith("-"))


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def training_plan(script_args, training_args, model_args, world_size: int | None = None) -> dict:
    """What a run would do, computed from the configuration alone (no weights, no data)."""
    world_size = world_size or script_args.num_processes or world_size_from_env()
    sp = getattr(training_args, "sequence_parallel_size", 1) or 1
    if world_size % sp:
        raise ValueError(f"sequence_parallel_size={sp} does not divide the world size {world_size}.")
    dp = world_size // sp
    per_device = training_args.per_device_train_batch_size
    accumulation = training_args.gradient_accumulation_steps
    row_tokens = getattr(training_args, "max_tokens_per_row", None)
    plan = {
        "stage": script_args.stage,
        "model": model_args.model_name_or_path,
        "world_size": world_size,
        "sequence_parallel_size": sp,
        "ring_groups": [list(range(g * sp, (g + 1) * sp)) for g in range(dp)],
        "data_parallel_size": dp,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "global_batch_size": per_device * accumulation * dp,
        "batch_unit": "packed rows" if row_tokens else ("examples" if script_args.stage == "sft" else "groups"),
        "max_length": training_args.max_length,
        "max_tokens_per_row": row_tokens,
        "max_tokens_per_optimizer_step": (row_tokens * per_device * accumulation * dp) if row_tokens else None,
        "tokens_per_rank_per_row": (row_tokens // sp) if row_tokens else None,
        # Preference stages: whether a group's prompt is placed once for all its responses (tokens per row then
        # count it once; see `shared_prefix`).
        "shared_prefix": bool(getattr(training_args, "shared_prefix", False)) and bool(training_args.padding_free),
        "use_peft": model_args.use_peft,
        "quantization": "4bit" if model_args.load_in_4bit else ("8bit" if model_args.load_in_8bit else None),
        "output_dir": training_args.output_dir,
    }
    return plan


def load_model(stage: str, model_args: ModelConfig, training_args):
    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl import get_quantization_config

    _, _, head = stage_classes(stage)
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    quantization_config = get_quantization_config(model_args)
    kwargs = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
        trust_remote_code=training_args.trust_remote_code,
    )
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        # Quantised weights are placed at load time: on this process's device (one copy per process under DDP).
        kwargs["device_map"] = "cpu" if training_args.use_cpu else {"": PartialState().local_process_index}
    if head == "seq-cls":
        return AutoModelForSequenceClassification.from_pretrained(
            model_args.model_name_or_path, num_labels=1, **kwargs
        )
    return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)


def peft_config_for(stage: str, model_args: ModelConfig):
    from trl import get_peft_config

    if STAGES[stage][2] == "seq-cls" and model_args.use_peft:
        # The score head is new: it must always train. PEFT's SEQ_CLS task keeps it in `modules_to_save`.
        model_args.lora_task_type = "SEQ_CLS"
        modules = list(model_args.lora_modules_to_save or [])
        if "score" not in modules:
            model_args.lora_modules_to_save = [*modules, "score"]
    return get_peft_config(model_args)


def resolve_resume(training_args):
    """`resume_from_checkpoint`: a checkpoint path, or `last`/`true` for the newest checkpoint in `output_dir`
    (none yet: start from scratch, so the same command both starts and resumes a run)."""
    from transformers.trainer_utils import get_last_checkpoint

    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("last", "true"):
        output_dir = Path(training_args.output_dir)
        resume = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
        logger.warning("Resuming from %s.", resume or "scratch (no checkpoint in output_dir yet)")
    return resume


def run(script_args, training_args, model_args):
    """Load the model and data, train (resuming when asked), save the model (and the merged model if asked)."""
    from transformers import AutoTokenizer

    from trl_longrm.data import load_raw_dataset

    stage = script_args.stage
    trainer_cls, _, _ = stage_classes(stage)
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    model = load_model(stage, model_args, training_args)
    train_dataset = load_raw_dataset(script_args.dataset_name, split=script_args.dataset_train_split)
    eval_dataset = None
    if script_args.dataset_test_split:
        eval_dataset = load_raw_dataset(script_args.dataset_name, split=script_args.dataset_test_split)
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config_for(stage, model_args),
    )
    trainer.train(resume_from_checkpoint=resolve_resume(training_args))
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json (log history, steps) beside the final model
    if trainer.accelerator.is_main_process:
        tokenizer.save_pretrained(training_args.output_dir)
        if script_args.save_merged_model and model_args.use_peft:
            merged_dir = Path(training_args.output_dir) / "merged"
            merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
            merged.save_pretrained(merged_dir)
            tokenizer.save_pretrained(merged_dir)
    return trainer


def main(argv: list[str] | None = None) -> int:
    script_args, training_args, model_args = parse_args(argv)
    if script_args.dry_run:
        plan = training_plan(script_args, training_args, model_args)
        print(json.dumps({"plan": plan}, indent=2, default=str))
        print(json.dumps({"training_args": training_args.to_dict()}, indent=2, default=str))
        return 0
    trainer = run(script_args, training_args, model_args)
    # Tear the process group down before the interpreter exits: a gloo group left to static destructors can abort a
    # rank at exit ("terminate called without an active exception", exit -6) after a run that finished and saved.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return 0
