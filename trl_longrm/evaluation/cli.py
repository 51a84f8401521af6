"""The `trl-longrm eval` subcommand: flags built from `EvalConfig`, and the entry point that runs it."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing

from trl_longrm.evaluation.config import DATA_FORMATS, DTYPES, FORMATS, JUDGE_PROTOCOLS, PROTOCOLS, EvalConfig


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
        if hint is bool:
            # A flag that defaults to on (`--verdict-probs`) also gets a `--no-...` form to turn it off.
            action = argparse.BooleanOptionalAction if field.default else "store_true"
            kwargs.update(action=action, default=field.default)
        elif typing.get_origin(hint) is list:
            kwargs.update(nargs="+", default=field.default_factory())
            if field.name == "formats":
                kwargs["choices"] = list(FORMATS)
        else:
            base = int if hint is int else str
            kwargs.update(type=base, required=required)
            if not required:
                kwargs["default"] = field.default
            choices = {
                "dtype": DTYPES,
                "data_format": DATA_FORMATS,
                "judge_protocol": JUDGE_PROTOCOLS,
                "protocol": PROTOCOLS,
            }
            if field.name in choices:
                kwargs["choices"] = list(choices[field.name])
        parser.add_argument(flag, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The `EvalConfig` of parsed `eval` flags."""
    return EvalConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(EvalConfig)})


def run_eval(args: argparse.Namespace) -> int:
    """Run `trl-longrm eval` with parsed flags; prints the Markdown table and returns the exit code."""
    # Imported here: they pull in torch and transformers, which `trl-longrm --help` does not need.
    from trl_longrm.evaluation.report import markdown_table
    from trl_longrm.evaluation.runner import evaluate_reward_model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    results = evaluate_reward_model(config)
    print(markdown_table(results))
    print(f"Predictions and results written to {config.save_path}")
    return 0
