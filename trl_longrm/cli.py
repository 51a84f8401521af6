"""`trl-longrm` command line: `train` runs a training stage from a recipe, `eval` runs Long-RewardBench."""

from __future__ import annotations

import argparse
import sys

from trl_longrm.evaluation.cli import add_eval_arguments, run_eval


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-longrm",
        description="Train and evaluate long-context reward models (LongRM) with TRL.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.add_parser("train", help="Run a training stage (sft, simpo_grm, simpo_disrm) from a YAML recipe.")
    eval_parser = subparsers.add_parser(
        "eval",
        help="Evaluate a reward model on Long-RewardBench.",
        description="Evaluate a generative or discriminative reward model on Long-RewardBench (resumable).",
    )
    add_eval_arguments(eval_parser)
    eval_parser.set_defaults(handler=run_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, _ = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.error(f"`{args.command}` is not available yet.")
    # Subcommands with a handler take no unknown flags: re-parse strictly so that typos are errors.
    return handler(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
