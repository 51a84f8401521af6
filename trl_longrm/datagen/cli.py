"""`trl-longrm data`: run one data step (`trl-longrm data expand --input ...`) or a YAML pipeline of them
(`trl-longrm data recipes/data/longrm_stage2.yaml`). Each step's flags are its config's fields (`--kebab-case`);
models, sources and other mappings are given as YAML text (`--judges "{name: a, backend: vllm, model: ./a}"`).

A pipeline file lists its steps in order, each a mapping of its config's fields with `step:` naming it; a step of
`respond`, `judge` or `vote` without `input` reads the previous step's output. `--steps` runs some of them. Every
step is checked before the first one runs; each resumes where it stopped, so the same command goes on after a crash.
A user's mistake (a missing file or key, a server that does not answer, a judge that writes no score) is one message
naming the file, row or server, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

import yaml


def _steps() -> dict:
    from trl_longrm.datagen.distill import DistillConfig, distill
    from trl_longrm.datagen.expand import ExpandConfig, expand
    from trl_longrm.datagen.judge import JudgeConfig, judge
    from trl_longrm.datagen.mix import MixConfig, mix
    from trl_longrm.datagen.respond import RespondConfig, respond
    from trl_longrm.datagen.vote import VoteConfig, vote

    return {
        "expand": (
            ExpandConfig,
            expand,
            "Short records + a distractor corpus -> long prompts at target token lengths.",
        ),
        "respond": (RespondConfig, respond, "Responses sampled from one or more models, with perturbations."),
        "judge": (
            JudgeConfig,
            judge,
            "Each response judged pointwise by several judges on the short context (cached).",
        ),
        "vote": (VoteConfig, vote, "Consensus voting into SFT, SimPO and DisRM rows; drops counted by reason."),
        "mix": (MixConfig, mix, "Long and short data mixed by counts or ratios."),
        "distill": (DistillConfig, distill, "Best-of-N rollouts of a policy scored by a reward model -> SFT rows."),
    }


STEP_NAMES = ("expand", "respond", "judge", "vote", "mix", "distill")
# The steps that read, without an `input` of their own, the previous step's output in a pipeline.
CHAINED = {"respond", "judge", "vote"}


def _yaml_value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise argparse.ArgumentTypeError(f"not YAML: {error}") from None


def step_parser(name: str) -> argparse.ArgumentParser:
    """The flags of step `name`: one `--kebab-case` flag per field of its config, with the field's help."""
    config_cls, _, description = _steps()[name]
    parser = argparse.ArgumentParser(prog=f"trl-longrm data {name}", description=description)
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        kwargs = {"dest": f.name, "help": f.metadata.get("help")}
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if args else hint
        origin = typing.get_origin(base)
        if base is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif origin is list or base is list:
            inner = typing.get_args(base)
            convert = inner[0] if inner and inner[0] in (int, float, str) else _yaml_value
            kwargs.update(nargs="+", type=convert, default=default)
        elif base in (int, float, str):
            kwargs.update(type=base, default=default, required=required)
        else:  # mappings and specs
            kwargs.update(type=_yaml_value, default=default, required=required)
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kwargs)
    return parser


def make_config(name: str, values: dict, where: str):
    """Step `name`'s config from `values`; an unknown or bad field is a `RunConfigError` naming `where`."""
    from trl_longrm.data.errors import RunConfigError

    config_cls = _steps()[name][0]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise RunConfigError(f"{where}: unknown key(s) {unknown} of step {name!r}; expected some of {sorted(known)}")
    try:
        return config_cls(**values)
    except TypeError as error:  # a required field missing
        raise RunConfigError(f"{where}: {error}".replace("__init__() ", "")) from None
    except ValueError as error:
        if isinstance(error, RunConfigError):
            raise
        raise RunConfigError(f"{where}: {error}") from None


def _output_of(config) -> str | None:
    return getattr(config, "output", None) or getattr(config, "simpo_output", None)


def read_pipeline(path: str | Path, only: list[str] | None = None) -> list[tuple[str, object]]:
    """The steps of a pipeline file as `(name, config)`, each checked; `only` keeps the steps of those names."""
    from trl_longrm.data.errors import RunConfigError

    path = Path(path)
    if not path.is_file():
        raise RunConfigError(f"{path}: no such file (resolved against {Path.cwd()})")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise RunConfigError(f"{path}: not a readable YAML file ({error})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("steps"), list) or not raw["steps"]:
        raise RunConfigError(f"{path}: a pipeline is a mapping with `steps`, a list of steps (each with `step:`)")
    unknown = sorted(set(raw) - {"steps"})
    if unknown:
        raise RunConfigError(f"{path}: unknown key(s) {unknown}; a pipeline has `steps`")
    steps, previous = [], None
    for i, entry in enumerate(raw["steps"]):
        where = f"{path}: steps[{i}]"
        if not isinstance(entry, dict) or entry.get("step") not in STEP_NAMES:
            raise RunConfigError(f"{where}: each step is a mapping with `step:` one of {list(STEP_NAMES)}")
        name = entry["step"]
        values = {key: value for key, value in entry.items() if key != "step"}
        if name in CHAINED and "input" not in values:
            if previous is None:
                raise RunConfigError(f"{where} ({name}): `input` is missing and no step before it writes one")
            values["input"] = previous
        config = make_config(name, values, f"{where} ({name})")
        previous = _output_of(config)
        steps.append((name, config))
    if only:
        unknown = sorted(set(only) - {name for name, _ in steps})
        if unknown:
            raise RunConfigError(f"{path}: --steps names {unknown}, which the pipeline does not have")
        steps = [(name, config) for name, config in steps if name in only]
    return steps


def run_step(name: str, config) -> dict:
    return _steps()[name][1](config)


def main(argv: list[str]) -> int:
    """`trl-longrm data ...`; returns the exit code."""
    from trl_longrm.data.errors import USER_ERRORS, report_user_error
    from trl_longrm.serving.base import EngineError

    usage = (
        "usage: trl-longrm data STEP [--flags]   (STEP: " + ", ".join(STEP_NAMES) + "; `trl-longrm data STEP -h`)\n"
        "       trl-longrm data PIPELINE.yaml [--steps STEP ...]\n\n" + __doc__.split("\n\n")[0]
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    try:
        if argv[0].endswith((".yaml", ".yml")):
            parser = argparse.ArgumentParser(prog=f"trl-longrm data {argv[0]}")
            parser.add_argument("--steps", nargs="+", choices=STEP_NAMES, help="Run only these steps of the pipeline.")
            options = parser.parse_args(argv[1:])
            steps = read_pipeline(argv[0], options.steps)
        elif argv[0] in STEP_NAMES:
            values = vars(step_parser(argv[0]).parse_args(argv[1:]))
            steps = [(argv[0], make_config(argv[0], values, f"trl-longrm data {argv[0]}"))]
        else:
            print(f"trl-longrm data: unknown step or pipeline {argv[0]!r}\n\n{usage}", file=sys.stderr)
            return 2
        for name, config in steps:
            run_step(name, config)
    except (*USER_ERRORS, EngineError) as error:
        return report_user_error(error)
    return 0
