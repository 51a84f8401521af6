"""The `trl-longrm eval` subcommand: flags built from `EvalConfig`, and the entry point that runs it."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import typing

from trl_longrm.evaluation.config import (
    BACKENDS,
    DATA_FORMATS,
    DTYPES,
    FORMATS,
    JUDGE_PROTOCOLS,
    PROTOCOLS,
    EvalConfig,
)


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one `--kebab-case` flag per `EvalConfig` field (help text from the field metadata) to `parser`.

    Example:
    ```python
    >>> parser = argparse.ArgumentParser()
    >>> args = add_eval_arguments(parser).parse_args(["--model-path", "m", "--data-path", "d", "--is-disrm"])
    >>> args.is_disrm
    True
    ```
    """
    hints = typing.get_type_hints(EvalConfig)
    for field in dataclasses.fields(EvalConfig):
        flag = "--" + field.name.replace("_", "-")
        kwargs: dict = {"dest": field.name, "help": field.metadata["help"]}
        hint = hints[field.name]
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if hint == (bool | None):
            # Not given (None) unless `--x` or `--no-x`: a backend's setting that another backend refuses.
            kwargs.update(action=argparse.BooleanOptionalAction, default=None)
        elif hint is bool:
            # A flag that defaults to on (`--verdict-probs`) also gets a `--no-...` form to turn it off.
            action = argparse.BooleanOptionalAction if field.default else "store_true"
            kwargs.update(action=action, default=field.default)
        elif typing.get_origin(hint) is list:
            kwargs.update(nargs="+", default=field.default_factory())
            if field.name == "formats":
                kwargs["choices"] = list(FORMATS)
        else:
            base = next((t for t in (int, float) if hint in (t, t | None)), str)
            kwargs.update(type=base, required=required)
            if not required:
                kwargs["default"] = field.default
            choices = {
                "dtype": DTYPES,
                "data_format": DATA_FORMATS,
                "judge_protocol": JUDGE_PROTOCOLS,
                "protocol": PROTOCOLS,
                "backend": BACKENDS,
            }
            if field.name in choices:
                kwargs["choices"] = list(choices[field.name])
        parser.add_argument(flag, **kwargs)
    parser.add_argument(
        "--num-processes",
        dest="num_processes",
        type=int,
        default=1,
        help="Processes to judge with, started through `accelerate launch` (one per GPU; on CPU they share the cores). "
        "The records are dealt out over the processes and the results equal one process's. Default 1. Under your own "
        "`accelerate launch -m trl_longrm eval ...` leave it out: the launcher's processes are used.",
    )
    return parser


def config_flags(config: EvalConfig) -> list[str]:
    """The `eval` flags that give back `config` (what the processes of a multi-process launch are started with),
    except the API key: a command line is visible to every user of the machine (`ps`), so `run_eval` passes it to them in
    `OPENAI_API_KEY` instead.

    Example:
    ```python
    >>> config_flags(EvalConfig(model_path="m", data_path="d", is_disrm=True))[:4]
    ['--model-path', 'm', '--data-path', 'd']
    ```
    """
    flags = []
    for field in dataclasses.fields(EvalConfig):
        value = getattr(config, field.name)
        flag = "--" + field.name.replace("_", "-")
        if field.name == "api_key":
            continue
        if isinstance(value, bool):
            # Flags that default to on, or to not given (None), have a `--no-...` form; the others are off unless given.
            flags += [flag] if value else ([f"--no-{flag[2:]}"] if field.default is not False else [])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def launch_command(config: EvalConfig, num_processes: int) -> list[str]:
    """`accelerate launch` of `python -m trl_longrm eval` on `num_processes` processes (torchrun launcher: GPUs when
    there are, else CPU processes over gloo)."""
    import sys

    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes)]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*launcher, "-m", "trl_longrm", "eval", *config_flags(config)]


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The `EvalConfig` of parsed `eval` flags."""
    return EvalConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(EvalConfig)})


def run_eval(args: argparse.Namespace) -> int:
    """Run `trl-longrm eval` with parsed flags; prints the Markdown table and returns the exit code."""
    # Imported here: they pull in torch and transformers, which `trl-longrm --help` does not need.
    from trl_longrm.data.errors import USER_ERRORS, report_user_error
    from trl_longrm.evaluation.report import markdown_table
    from trl_longrm.evaluation.runner import evaluate_reward_model
    from trl_longrm.serving.base import EngineError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)  # checks the flags together: every error is a bad value or combination
    except ValueError as error:
        return report_user_error(error)
    if args.num_processes < 1:
        return report_user_error(f"--num-processes must be >= 1, got {args.num_processes}.")
    if args.num_processes > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # Not launched yet: start the processes. Processes x threads must not exceed the cores.
        from trl_longrm.cpu_threads import launch_env

        env = launch_env(args.num_processes)
        if config.api_key is not None:
            env["OPENAI_API_KEY"] = config.api_key  # not on the command line (`config_flags`)
        command = launch_command(config, args.num_processes)
        print("Launching:", " ".join(command), flush=True)
        return subprocess.call(command, env=env)
    try:
        results = evaluate_reward_model(config)
    # Bad data, flags or model; a missing folder or file; a server down, too slow, or refusing the requests.
    except (*USER_ERRORS, FileNotFoundError, EngineError) as error:
        return report_user_error(error)
    if int(os.environ.get("RANK", "0")) == 0:
        print(markdown_table(results))
        print(f"Predictions and results written to {config.save_path}")
    return 0


# ------------------------------------------------------------------------------------------------ trl-longrm score


def add_score_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One `--kebab-case` flag per `ScoreConfig` field, and `--num-processes`."""
    from trl_longrm.evaluation.config import ScoreConfig

    hints = typing.get_type_hints(ScoreConfig)
    for field in dataclasses.fields(ScoreConfig):
        flag = "--" + field.name.replace("_", "-")
        kwargs: dict = {"dest": field.name, "help": field.metadata["help"]}
        hint = hints[field.name]
        required = field.default is dataclasses.MISSING
        if hint is bool or hint == (bool | None):
            kwargs.update(action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kwargs.update(type=int if hint is int else str, required=required)
            if not required:
                kwargs["default"] = field.default
            if field.name == "dtype":
                kwargs["choices"] = list(DTYPES)
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--num-processes", dest="num_processes", type=int, default=1,
                        help="Processes to score with, started through `accelerate launch`; rows are dealt out over "
                        "them. Default 1.")  # fmt: skip
    return parser


def run_score(args: argparse.Namespace) -> int:
    """Run `trl-longrm score`: bad input is reported by file, line and key (exit 1) before any model loads."""
    import sys

    from trl_longrm.data.errors import USER_ERRORS, report_user_error
    from trl_longrm.evaluation.score import ScoreConfig, read_rows, score

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = ScoreConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ScoreConfig)})
    except ValueError as error:  # a bad flag value
        return report_user_error(error)
    if args.num_processes < 1:
        return report_user_error(f"--num-processes must be >= 1, got {args.num_processes}.")
    try:
        read_rows(config.data_path)
        if args.num_processes > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            from trl_longrm.cpu_threads import launch_env

            flags = []
            for field in dataclasses.fields(ScoreConfig):
                value, flag = getattr(config, field.name), "--" + field.name.replace("_", "-")
                if isinstance(value, bool):
                    flags.append(flag if value else f"--no-{flag[2:]}")
                elif value is not None:
                    flags += [flag, str(value)]
            command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                       str(args.num_processes), "--num_machines", "1", "--mixed_precision", "no",
                       "--dynamo_backend", "no", "-m", "trl_longrm", "score", *flags]  # fmt: skip
            print("Launching:", " ".join(command), flush=True)
            return subprocess.call(command, env=launch_env(args.num_processes))
        score(config)
    except (*USER_ERRORS, FileNotFoundError) as error:  # bad rows, flags or model; a missing file
        return report_user_error(error)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"Scores written to {config.output}")
    return 0
