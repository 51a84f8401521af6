"""Run one LongRM training stage from a YAML recipe: `python -m trl_longrm recipe.yaml` (what
`accelerate launch -m trl_longrm recipe.yaml` runs on every process, and `accelerate launch recipe.yaml` through
`trl_longrm.recipe_codec`).

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

import functools
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, ScriptArguments, TrlParser

from trl_longrm.data.errors import USER_ERRORS, DataFormatError, RunConfigError, report_user_error
from trl_longrm.launch import (
    RECIPE_FIRST_LINE,
    find_accelerate_config,
    flag_value,
    positional_recipe_to_config,
    read_recipe,
    runs_under_accelerate_launch,
)
from trl_longrm.sequence_parallel.config import ulysses_group_size
from trl_longrm.stages import STAGES, peft_config_for, stage_classes  # noqa: F401 - importable from here too


logger = logging.getLogger(__name__)

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
            "help": "Print the plan (world size, ring groups, batch sizes, tokens per step, and with `memory_plan` "
            "each rank's memory) and exit without loading weights. Default False."
        },
    )
    dry_run_output: str = field(
        default="summary",
        metadata={
            "help": "What --dry_run prints: 'summary' (the layout, the few settings that decide the memory, and the "
            "memory plan's table) or 'json' (the whole plan, the resolved training arguments and the memory plan as "
            "JSON, then the table). Default 'summary'.",
            "choices": ["summary", "json"],
        },
    )
    memory_plan: bool = field(
        default=True,
        metadata={
            "help": "With --dry_run, also print each rank's memory plan (weights, gradients, optimizer states, "
            "activations, temporaries, named DeepSpeed/CUDA terms, peak), traced from one optimizer step of the "
            "trainer on fake tensors (`trl_longrm.memory_plan`), and whether it fits `device_memory_gib`. Default True."
        },
    )
    model_config: str | None = field(
        default=None,
        metadata={
            "help": "config.json whose model shape the memory plan traces, for a model not on disk yet (a Hub name, "
            "an earlier stage's output): relative to the working directory, else to the recipe's folder, else a "
            "shape bundled with the package by name (qwen3-8b, llama-3.1-8b). Default None: "
            "`model_name_or_path`/config.json when local. Nothing is downloaded."
        },
    )
    plan_device: str = field(
        default="h100-80gb",
        metadata={
            "help": "The GPU the memory plan checks the peak against, by the memory a process gets on it as measured "
            "here (`trl_longrm.memory_plan.devices`): 'h100-80gb' (79.15 GiB) or 'h200' (139.8 GiB). Default "
            "'h100-80gb'."
        },
    )
    device_memory_gib: float | None = field(
        default=None,
        metadata={
            "help": "Instead of `plan_device`: the memory (GiB) a process gets on one device, as "
            "`torch.cuda.mem_get_info()[1]` reports it (an '80 GB' H100 gives 79.2). Default None."
        },
    )
    plan_prompt_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Prompt tokens of the group the memory plan traces. Default None: `max_length` minus "
            "`plan_response_tokens` (the longest group the run admits)."
        },
    )
    plan_response_tokens: int = field(
        default=2048, metadata={"help": "Tokens of each response of the planned group. Default 2048."}
    )
    plan_longest_group: bool = field(
        default=False,
        metadata={
            "help": "With --dry_run's memory plan, also search the longest prompt (same responses, k and layout) "
            "whose plan fits `device_memory_gib`, each step a traced plan (a few minutes for an 8B model). Default "
            "False."
        },
    )
    plan_num_rejected: int = field(
        default=4,
        metadata={
            "help": "Rejected responses per planned group (preference stages), at most the trainer's `num_rejected`. "
            "Default 4 (LongRM's rows)."
        },
    )
    accelerate_config: str | None = field(
        default=None,
        metadata={
            "help": "Accelerate config file that `trl-longrm train` launches with (a path, or a file name under "
            "accelerate_configs/). Not read by `accelerate launch recipe.yaml`, which runs with accelerate's own "
            "flags (a note says where they differ). Default None: accelerate's default."
        },
    )
    num_processes: int | None = field(
        default=None,
        metadata={"help": "Processes `trl-longrm train` launches. Default None: the accelerate config's number."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh even where `output_dir` holds checkpoints or the final model of an earlier run: "
            "its `checkpoint-N` folders and trainer state are deleted first. Default False: the same command resumes "
            "from the newest complete checkpoint, and a finished run is not trained again."
        },
    )
    save_merged_model: bool = field(
        default=False,
        metadata={
            "help": "With LoRA/QLoRA, also save the base model with the adapter merged into `output_dir/merged`, so "
            "the next stage can start from it as a plain model. With QLoRA the 4-bit base is dequantised first (to "
            "bf16 with `bf16`, else the model's dtype), so `merged/` needs no bitsandbytes. Default False."
        },
    )


def resolve_stage(argv: list[str]) -> str | None:
    stage = flag_value(argv, "--stage") or read_recipe(argv).get("stage")
    if stage is not None and stage not in STAGES:
        raise ValueError(f"Unknown stage {stage!r}; expected one of {sorted(STAGES)}.")
    return stage


RESUME_HELP = (
    "Checkpoint to resume from: a `checkpoint-N` folder, or `last`/`true` for the newest complete one in `output_dir` "
    "(a damaged one is skipped). Default None: the same, so re-running a command resumes it; `false` refuses to mix "
    "a new run with an earlier run's checkpoints (use --overwrite_output_dir)."
)


def build_parser(stage: str | None) -> TrlParser:
    if stage is None:
        return TrlParser((LongRMScriptArguments, ModelConfig))
    parser = TrlParser((LongRMScriptArguments, stage_classes(stage)[1], ModelConfig))
    for action in parser._actions:
        if action.dest == "resume_from_checkpoint":
            # TrainingArguments says the Trainer ignores it; here it is what `run` resumes from.
            action.help = RESUME_HELP
    return parser


def parse_args(argv: list[str] | None = None, check_only: bool = False):
    """`(script_args, training_args, model_args)` of a recipe plus command-line overrides. `check_only` (as
    `--dry_run`) validates the arguments as for a CPU where no GPU is present (the launcher's machine may have none)."""
    argv = positional_recipe_to_config(sys.argv[1:] if argv is None else argv)
    stage = resolve_stage(argv)
    parser = build_parser(stage)
    if stage is None:
        if "-h" in argv or "--help" in argv:
            parser.parse_args_and_config(argv)  # prints the shared options and exits
        parser.error(f"No `stage` given: set `stage:` in the recipe or pass --stage, one of {sorted(STAGES)}.")
    if (check_only or _wants_dry_run(argv)) and flag_value(argv, "--use_cpu") is None and not _has_accelerator():
        # TrainingArguments refuses bf16 without a GPU; a dry run only validates and prints, so validate as CPU.
        argv = [*argv, "--use_cpu", "true"]
    with warnings.catch_warnings():
        # TRL's configs (and our recipes) spell it `gradient_checkpointing`, which transformers 5 renames with a
        # FutureWarning on every parse; the setting itself is honoured.
        warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)
        return parser.parse_args_and_config(argv)


def _wants_dry_run(argv: list[str]) -> bool:
    value = flag_value(argv, "--dry_run") or flag_value(argv, "--dry-run")
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
        # ring | ulysses | hybrid, and the ranks of a Ulysses (all-to-all over heads) group (1 for the ring).
        "sequence_parallel_mode": getattr(training_args, "sequence_parallel_mode", "ring") if sp > 1 else None,
        "ulysses_size": (
            ulysses_group_size(training_args.sequence_parallel_mode, sp, training_args.ulysses_size) if sp > 1 else None
        ),
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
        "start": _describe_start(script_args, training_args),
    }
    return plan


def _describe_start(script_args, training_args) -> str:
    try:
        return start_plan(script_args, training_args).describe()
    except ValueError as error:  # reported among the problems of `check_paths`
        return f"cannot start: {error}"


def _model_problems(model: str, problems: list[str], notes: list[str]) -> None:
    from trl_longrm.data.sources import looks_local, missing_path_message

    path = Path(model).expanduser()
    if not path.exists():
        if looks_local(model):
            problems.append(f"model_name_or_path={model!r}: {missing_path_message(model)}")
        else:
            notes.append(f"model_name_or_path={model!r} is no local folder (in {Path.cwd()}): read from the Hub")
        return
    if not path.is_dir():
        problems.append(f"model_name_or_path={model!r}: a file, not a folder saved with `save_pretrained`")
        return
    adapter = path / "adapter_config.json"
    if adapter.is_file():
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        except ValueError as error:
            problems.append(f"{adapter}: unreadable ({error})")
            return
        if base and not Path(base).expanduser().exists() and looks_local(base):
            # PEFT reads a relative base from the working directory, not from the adapter's folder.
            beside = path / base
            hint = (
                f"; it exists relative to the adapter ({beside.resolve()}): write that absolute path in {adapter}"
                if beside.exists()
                else ""
            )
            problems.append(
                f"model_name_or_path={model!r} is a LoRA adapter whose base_model_name_or_path {base!r}: "
                f"{missing_path_message(base)}{hint}"
            )
        return
    if not (path / "config.json").is_file():
        problems.append(f"model_name_or_path={model!r}: the folder holds no config.json (not a saved model)")


def _dataset_problems(script_args, problems: list[str], notes: list[str]) -> None:
    from trl_longrm.data.sources import empty_file_reason, file_split_problem, looks_local, missing_path_message

    data = script_args.dataset_name
    path = Path(data).expanduser()
    if path.is_file():
        for option in ("dataset_train_split", "dataset_test_split"):
            split = getattr(script_args, option)
            problem = file_split_problem(path, split) if split is not None else None
            if problem:
                problems.append(f"{option}={split!r}: {data}: {problem}")
        reason = empty_file_reason(path)
        if reason:
            problems.append(f"dataset_name={data!r}: {reason}")
    elif not path.exists():
        if looks_local(data):
            problems.append(f"dataset_name={data!r}: {missing_path_message(data)}")
        else:
            notes.append(f"dataset_name={data!r} is no local file or folder (in {Path.cwd()}): read from the Hub")


def check_paths(script_args, training_args, model_args) -> tuple[list[str], list[str]]:
    """Every problem with the paths a run reads (model, adapter base, dataset and its splits, accelerate config,
    checkpoint to resume from), found without loading anything; and notes on names that will be read from the Hub.

    Example:
    ```python
    >>> problems, notes = check_paths(*parse_args(["recipes/tiny/sft.yaml", "--dataset_name", "nope.jsonl"]))
    >>> problems[-1]
    "dataset_name='nope.jsonl': no such file or folder (resolved against /home/me/project)"
    ```
    """
    problems, notes = [], []
    if model_args.model_name_or_path is None:
        problems.append("model_name_or_path is not set")
    else:
        _model_problems(model_args.model_name_or_path, problems, notes)
    if script_args.dataset_name is None:
        problems.append("dataset_name is not set")
    else:
        _dataset_problems(script_args, problems, notes)
    if script_args.accelerate_config:
        try:
            find_accelerate_config(str(script_args.accelerate_config))
        except FileNotFoundError as error:
            problems.append(f"accelerate_config: {error}")
    try:
        start_plan(script_args, training_args)
    except ValueError as error:
        problems.append(str(error))
    from trl_longrm.memory_plan.devices import device_memory_bytes

    try:
        device_memory_bytes(script_args.plan_device, script_args.device_memory_gib)
    except ValueError as error:  # a card whose memory is not known
        problems.append(str(error))
    return problems, notes


def problems_message(problems: list[str]) -> str:
    return "the run cannot start:\n  - " + "\n  - ".join(problems)


def all_dropped_message(report) -> str:
    """Why no row of a dataset is left, with the counts per reason and the option to change."""
    reasons = "; ".join(f"{count} {reason}" for reason, count in report.dropped_by_reason.items())
    advice = (
        "Raise --max_length, or pass --truncation truncate_prompt to cut the middle of long prompts instead."
        if report.truncation == "drop"
        else "Raise --max_length: it must hold the longest response plus part of the prompt."
    )
    return (
        f"{report.source}: every row was dropped, none is left to train on: of {report.num_rows} rows, {reasons} "
        f"(max_length={report.max_length} tokens). {advice}"
    )


def prepare_data(stage: str, source: str, split: str | None, tokenizer, training_args):
    """Read, normalise and tokenise one split of `source` as the stage's trainer would, so that data errors come
    before the model loads and name the file and line. Raises `RunConfigError` where no row is left."""
    from trl_longrm.data import (
        load_preference_dataset,
        load_sft_dataset,
        tokenize_preference_dataset,
        tokenize_sft_dataset,
    )
    from trl_longrm.data.sources import locate_error

    args = training_args
    name = source if Path(source).is_file() else f"{source} [split={split}]"
    try:
        if stage == "sft":
            rows = load_sft_dataset(source, split=split, prompt_key=args.prompt_key, completion_key=args.chosen_key)
            tokenize = functools.partial(tokenize_sft_dataset, assistant_only_loss=args.assistant_only_loss)
        else:
            rows = load_preference_dataset(
                source,
                split=split,
                prompt_key=args.prompt_key,
                chosen_key=args.chosen_key,
                rejected_key=args.rejected_key,
                num_rejected=args.num_rejected,
            )
            # A reward model's sequences keep the template's whole rendering, where the score is read.
            tokenize = functools.partial(tokenize_preference_dataset, whole_rendering=stage == "simpo_disrm")
        dataset, report = tokenize(
            rows,
            tokenizer,
            max_length=args.max_length,
            truncation=args.truncation,
            num_proc=args.dataset_num_proc,
            source_name=name,
        )
    except DataFormatError as error:
        raise locate_error(error, source) from None
    if report.num_kept == 0:
        raise RunConfigError(all_dropped_message(report))
    return dataset


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


def start_plan(script_args, training_args):
    """How this run starts (afresh, resumed from a checkpoint, or not at all: finished); see `trl_longrm.resume`."""
    from trl_longrm.resume import plan_start

    return plan_start(
        training_args.output_dir,
        training_args.resume_from_checkpoint,
        script_args.overwrite_output_dir,
        max_steps=training_args.max_steps,
        num_train_epochs=training_args.num_train_epochs,
    )


def is_main_process() -> bool:
    # Before accelerate starts: the launcher's global rank (multi-node too), 0 for a single process.
    return os.environ.get("RANK", "0") == "0"


class _ReachedMaxSteps(Exception):
    """Raised by `_StopAtMaxSteps` where a resumed checkpoint is already the end of training."""


def _stop_at_max_steps_callback():
    from transformers import TrainerCallback

    class _StopAtMaxSteps(TrainerCallback):
        # The Trainer resumed at `global_step == max_steps` still runs one more optimizer step before it checks.
        def on_train_begin(self, args, state, control, **kwargs):
            if state.max_steps > 0 and state.global_step >= state.max_steps:
                raise _ReachedMaxSteps

    return _StopAtMaxSteps()


def run(script_args, training_args, model_args, start=None):
    """Load the model and data, train (resuming as `start` says), save the model (and the merged model if asked)."""
    from transformers import AutoTokenizer

    start = start or start_plan(script_args, training_args)
    stage = script_args.stage
    trainer_cls, _, _ = stage_classes(stage)
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    # The data first: its errors (and an empty result) are found in seconds, not after the model has loaded.
    source = script_args.dataset_name
    train_dataset = prepare_data(stage, source, script_args.dataset_train_split, tokenizer, training_args)
    eval_dataset = None
    if script_args.dataset_test_split:
        eval_dataset = prepare_data(stage, source, script_args.dataset_test_split, tokenizer, training_args)
    model = load_model(stage, model_args, training_args)
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config_for(stage, model_args),
    )
    if hasattr(trainer, "set_dataset_name"):  # for the model card
        trainer.set_dataset_name(script_args.dataset_name)
    if start.checkpoint is not None:
        trainer.add_callback(_stop_at_max_steps_callback())
    try:
        trainer.train(resume_from_checkpoint=start.checkpoint)
    except _ReachedMaxSteps:
        pass  # the checkpoint's weights and state are loaded: they are the final model, saved below
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json (log history, steps) beside the final model
    if trainer.accelerator.is_main_process:
        tokenizer.save_pretrained(training_args.output_dir)
        if script_args.save_merged_model and model_args.use_peft:
            from trl_longrm.merging import merged_dtype, save_merged_model

            merged_dir = save_merged_model(
                trainer.accelerator.unwrap_model(trainer.model),
                adapter_dir=training_args.output_dir,
                merged_dir=Path(training_args.output_dir) / "merged",
                load_base=lambda: load_model(stage, model_args, training_args),
                dtype=merged_dtype(training_args, model_args),
            )
            tokenizer.save_pretrained(merged_dir)
    return trainer


def main(argv: list[str] | None = None, notes: list[str] | tuple[str, ...] = ()) -> int:
    """Run (or with `--dry_run` check and plan) one stage; a user's mistake is printed once, without a traceback,
    and gives exit code 1. `notes` are printed (by rank 0) with the run's own."""
    argv = sys.argv[1:] if argv is None else argv
    script_args, training_args, model_args = parse_args(argv)
    if not is_main_process():
        # Every rank prepares the same data: its reports and progress bars are shown once, by rank 0.
        import datasets

        logging.getLogger("trl_longrm").setLevel(logging.ERROR)
        datasets.disable_progress_bars()
    try:
        notes = [*notes, *report_to_notes(argv, training_args)]
        if script_args.dry_run:
            notes += recipe_form_notes(argv)
        recipe = flag_value(positional_recipe_to_config(argv), "--config")
        recipe_dir = Path(recipe).resolve().parent if recipe else None
        return _main(script_args, training_args, model_args, notes, recipe_dir)
    except USER_ERRORS as error:
        return report_user_error(error)
    except KeyboardInterrupt:
        if is_main_process():
            print(
                f"Interrupted. The same command resumes from the newest complete checkpoint in "
                f"{training_args.output_dir}.",
                flush=True,
            )
        return 130


def preflight(argv: list[str]) -> int | None:
    """What `trl-longrm train` checks before it starts any process: the arguments, the paths, and whether the run
    already finished. Returns the exit code where there is nothing to launch (problems printed once), else None."""
    try:
        script_args, training_args, model_args = parse_args(argv, check_only=True)
    except ValueError as error:  # an unknown key, a bad value: TrlParser/TrainingArguments say which
        print(f"trl-longrm: error: {error}", file=sys.stderr, flush=True)
        return 1
    problems, _ = check_paths(script_args, training_args, model_args)
    if problems:
        print(f"trl-longrm: error: {problems_message(problems)}", file=sys.stderr, flush=True)
        return 1
    start = start_plan(script_args, training_args)
    if start.action == "finished" and not script_args.overwrite_output_dir:
        print(start.describe(), flush=True)
        return 0
    return None


def report_to_notes(argv: list[str], training_args) -> list[str]:
    """A note where `report_to: all` finds no tracker installed (TrainingArguments then reports to none, silently)."""
    argv = positional_recipe_to_config(argv)
    requested = flag_value(argv, "--report_to") or read_recipe(argv).get("report_to")
    if requested in ("all", ["all"]) and not training_args.report_to:
        return [
            "report_to=all: no tracker is installed (tensorboard, wandb, trackio, mlflow, ...), so metrics go only to "
            "the log and to trainer_state.json; install one, or name one in report_to"
        ]
    return []


def recipe_form_notes(argv: list[str]) -> list[str]:
    """A note where the recipe lacks the first line that lets `accelerate launch recipe.yaml` run it."""
    path = flag_value(positional_recipe_to_config(argv), "--config")
    if path is None or runs_under_accelerate_launch(path):
        return []
    return [
        f"{path}: its first line is not `{RECIPE_FIRST_LINE}`, so `accelerate launch {path}` would run the YAML as "
        "Python; `trl-longrm train` and `accelerate launch -m trl_longrm` run it as it is"
    ]


def typical_group_layout(script_args, training_args, model_args, sample: int = 64) -> dict:
    """Tokens per row of the data's typical (median-size) preference group in the shared-prefix layout and in the
    unshared one, from the first `sample` rows of the train split (tokenizer only, no weights)."""
    from transformers import AutoTokenizer

    from trl_longrm.data import load_preference_dataset, tokenize_preference_dataset
    from trl_longrm.packing import group_num_tokens
    from trl_longrm.trainers.common import uses_shared_prefix

    args = training_args
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, trust_remote_code=args.trust_remote_code
    )
    rows = load_preference_dataset(
        script_args.dataset_name,
        split=script_args.dataset_train_split,
        prompt_key=args.prompt_key,
        chosen_key=args.chosen_key,
        rejected_key=args.rejected_key,
        num_rejected=args.num_rejected,
    )
    rows = rows.select(range(min(sample, len(rows))))
    groups, _ = tokenize_preference_dataset(
        rows, tokenizer, max_length=args.max_length, truncation=args.truncation, source_name=script_args.dataset_name,
        whole_rendering=script_args.stage == "simpo_disrm",
    )  # fmt: skip
    if len(groups) == 0:
        return {"sampled_groups": 0}
    sizes = sorted((group_num_tokens(g, True), group_num_tokens(g, False)) for g in groups)
    shared, unshared = sizes[len(sizes) // 2]
    return {
        "sampled_groups": len(groups),
        "tokens_per_row_shared": shared,
        "tokens_per_row_unshared": unshared,
        "layout_used": "shared" if uses_shared_prefix(args) else "unshared",
    }


def print_memory_plan(script_args, training_args, model_args, world_size: int, recipe_dir: Path | None,
                      as_json: bool = False) -> None:  # fmt: skip
    """`--dry_run`'s memory plan (`trl_longrm.memory_plan.recipe`) as a table; with `as_json`, as JSON
    (`{"memory_plan": ...}`) first."""
    from trl_longrm.memory_plan.recipe import recipe_memory_plans

    summary, text = recipe_memory_plans(script_args, training_args, model_args, world_size, recipe_dir)
    if summary is None:
        print(f"note: {text}", file=sys.stderr, flush=True)
        return
    if as_json:
        print(json.dumps({"memory_plan": summary}, indent=2, default=str))
    print(text, flush=True)


def describe_plan(plan: dict, training_args) -> str:
    """`--dry_run`'s summary of `training_plan`: the layout and the settings that decide a step's memory, a line each
    (the whole configuration: `--dry_run_output json`)."""
    sp, dp = plan["sequence_parallel_size"], plan["data_parallel_size"]
    layout = "one process per row" if sp == 1 else (
        f"rows split over groups of {sp} ({plan['sequence_parallel_mode']}"
        + (f", Ulysses groups of {plan['ulysses_size']}" if plan["sequence_parallel_mode"] == "hybrid" else "") + ")")
    checkpointing = "off"
    if training_args.gradient_checkpointing:
        kwargs = training_args.gradient_checkpointing_kwargs or {}
        checkpointing = "selective" if kwargs.get("selective") else "on"
        checkpointing += ", inputs offloaded to host" if kwargs.get("offload") else ""
    precision = "bf16" if training_args.bf16 else ("fp16" if training_args.fp16 else "fp32")
    lines = [
        f"{plan['stage']} of {plan['model']} on {plan['world_size']} process(es): {layout}, {dp} data-parallel "
        f"replica(s); global batch {plan['global_batch_size']} {plan['batch_unit']} "
        f"({plan['per_device_train_batch_size']} x {plan['gradient_accumulation_steps']} accumulation x {dp})",
        f"  max_length {plan['max_length']:,}"
        + (f", {plan['max_tokens_per_row']:,} tokens per packed row" if plan["max_tokens_per_row"] else "")
        + (", shared prefix" if plan["shared_prefix"] else "")
        + f"; {precision}; gradient checkpointing {checkpointing}"
        + (f"; tiled MLP ({training_args.mlp_tile_tokens:,} tokens)" if getattr(training_args, "mlp_tile_tokens", None)
           else "")
        + ("; LoRA" if plan["use_peft"] else "; full parameters")
        + (f" ({plan['quantization']})" if plan["quantization"] else ""),
    ]
    if plan.get("typical_group"):
        lines.append(f"  typical group: {json.dumps(plan['typical_group'], default=str)}")
    lines.append(f"  output: {plan['output_dir']} ({plan['start']})")
    lines.append("  (the whole configuration: --dry_run_output json)")
    return "\n".join(lines)


def _main(script_args, training_args, model_args, notes: list[str] = (), recipe_dir: Path | None = None) -> int:
    problems, path_notes = check_paths(script_args, training_args, model_args)
    notes = [*notes, *path_notes]
    if is_main_process():
        for note in notes:
            print(f"note: {note}", file=sys.stderr, flush=True)
    if script_args.dry_run:
        plan = training_plan(script_args, training_args, model_args)
        local = Path(script_args.dataset_name).expanduser().exists() and Path(model_args.model_name_or_path).exists()
        if script_args.stage != "sft" and local and not problems:
            # What one group occupies in a row, with its prompt once (shared_prefix) and once per response.
            plan["typical_group"] = typical_group_layout(script_args, training_args, model_args)
        as_json = script_args.dry_run_output == "json"
        if as_json:
            print(json.dumps({"plan": plan}, indent=2, default=str))
            print(json.dumps({"training_args": training_args.to_dict()}, indent=2, default=str))
        else:
            print(describe_plan(plan, training_args), flush=True)
        if script_args.memory_plan and is_main_process():
            try:
                print_memory_plan(script_args, training_args, model_args, plan["world_size"], recipe_dir, as_json)
            except (FileNotFoundError, ValueError) as error:  # a model_config that is not there, a bad shape
                problems.append(f"memory plan: {error}")
        if problems:
            print(f"trl-longrm: error: {problems_message(problems)}", file=sys.stderr, flush=True)
            return 1
        return 0
    if problems:
        raise RunConfigError(problems_message(problems))
    start = start_plan(script_args, training_args)
    if is_main_process():
        for checkpoint, problem in start.skipped:
            logger.warning("Skipping damaged checkpoint %s: %s.", checkpoint, problem)
        if script_args.overwrite_output_dir:
            from trl_longrm.resume import clear_previous_run

            removed = clear_previous_run(training_args.output_dir)
            if removed:
                print(f"--overwrite_output_dir: removed the earlier run's {', '.join(removed)}.", flush=True)
        print(start.describe(), flush=True)
    if start.action == "finished":
        return 0
    trainer = run(script_args, training_args, model_args, start)
    # Tear the process group down before the interpreter exits: a gloo group left to static destructors can abort a
    # rank at exit ("terminate called without an active exception", exit -6) after a run that finished and saved.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return 0
