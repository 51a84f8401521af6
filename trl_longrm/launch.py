"""Launch settings of a recipe: the accelerate config and process count it names (`accelerate_config`,
`num_processes`, overridable by the flags after the recipe), where that config lies, and how they compare with the
processes a launch actually started.

`trl_longrm.cli` launches with these settings and `trl_longrm.train` checks them in every process; both import them
from here, and this module imports neither (nor anything heavy: the recipe codec imports it at interpreter start).
"""

from __future__ import annotations

import os
import re
from pathlib import Path


# A recipe's first line: a comment to YAML, and to Python (PEP 263) the source encoding that makes
# `accelerate launch recipe.yaml` (which runs `python recipe.yaml`) train it; see `trl_longrm.recipe_codec`. Not the
# `-*- coding: ... -*-` form: Emacs reads that one too, and warns of an unknown coding system.
RECIPE_CODEC = "trl_longrm"
RECIPE_FIRST_LINE = f"# coding: {RECIPE_CODEC}"
# How Python finds a source encoding in a file's first two lines (PEP 263).
_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")


def flag_value(argv: list[str], name: str) -> str | None:
    """The value of `name` in `argv` (`--name value` or `--name=value`), else None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def positional_recipe_to_config(argv: list[str]) -> list[str]:
    """`recipe.yaml` as the first argument means `--config recipe.yaml` (as `accelerate launch -m` passes it)."""
    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml")):
        return ["--config", argv[0], *argv[1:]]
    return list(argv)


def read_recipe(argv: list[str]) -> dict:
    """The mapping of the recipe that `--config` names in `argv` ({} without one)."""
    import yaml

    path = flag_value(argv, "--config")
    if path is None:
        return {}
    with open(path, encoding="utf-8") as handle:
        recipe = yaml.safe_load(handle) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"Recipe {path} must be a YAML mapping of option names to values.")
    return recipe


def runs_under_accelerate_launch(path: str | os.PathLike) -> bool:
    """Whether `accelerate launch path` trains the recipe: Python finds the recipe codec declared in it."""
    with open(path, "rb") as handle:
        lines = [handle.readline(), handle.readline()]
    for line in lines:
        found = _CODING.match(line)
        if found:
            return found.group(1).decode().lower().replace("-", "_") == RECIPE_CODEC
        if line.strip() and not line.lstrip().startswith(b"#"):
            return False  # the second line counts only after a comment or a blank line
    return False


def find_accelerate_config(name: str) -> str:
    """A path as given, else a file of that name under ./accelerate_configs or the project's accelerate_configs."""
    candidates = [
        Path(name),
        Path("accelerate_configs") / name,
        Path(__file__).resolve().parents[1] / "accelerate_configs" / name,
    ]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(f"Accelerate config {name!r} not found (looked at {', '.join(map(str, candidates))}).")


def read_accelerate_config(name: str) -> dict:
    import yaml

    with open(find_accelerate_config(name), encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def launch_settings(recipe: str, overrides: list[str]) -> tuple[str | None, str | None]:
    """The accelerate config and process count a run uses: the command line's, else the recipe's."""
    settings = read_recipe(["--config", recipe])
    accelerate_config = flag_value(overrides, "--accelerate_config") or settings.get("accelerate_config")
    num_processes = flag_value(overrides, "--num_processes") or settings.get("num_processes")
    return accelerate_config, num_processes


def local_processes(recipe: str, overrides: list[str]) -> int:
    """Processes this machine runs for `recipe`: its process count over the accelerate config's `num_machines`."""
    accelerate_config, processes = launch_settings(recipe, overrides)
    launcher = read_accelerate_config(str(accelerate_config)) if accelerate_config else {}
    processes = int(processes or launcher.get("num_processes") or 1)
    machines = int(launcher.get("num_machines") or 1)
    return max(1, processes // max(1, machines))


def config_engine(config: dict) -> str:
    """What an accelerate config wraps the model in, as accelerate launch then tells its processes."""
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        stage = (config.get("deepspeed_config") or {}).get("zero_stage")
        return f"DeepSpeed ZeRO-{stage}" if stage is not None else "DeepSpeed"
    return "FSDP" if kind == "FSDP" else "no DeepSpeed or FSDP"


def running_engine(env: dict[str, str]) -> str:
    """What the launch that started this process wraps the model in (the variables accelerate launch sets)."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed"
    return "FSDP" if env.get("ACCELERATE_USE_FSDP", "").lower() == "true" else "no DeepSpeed or FSDP"


def _processes(count: int) -> str:
    return f"{count} process" + ("" if count == 1 else "es")


def launch_mismatch(recipe: str, overrides: list[str], env: dict[str, str] | None = None) -> str | None:
    """One line where the processes this launch started (their number, DeepSpeed/FSDP) are not what the recipe's
    `accelerate_config` / `num_processes` ask for: those apply through `trl-longrm train`, which launches with them;
    `accelerate launch recipe.yaml` runs with accelerate's own flags and default config. None where they agree."""
    env = os.environ if env is None else env
    accelerate_config, num_processes = launch_settings(recipe, overrides)
    if not accelerate_config and not num_processes:
        return None
    config = {}
    if accelerate_config:
        try:
            config = read_accelerate_config(str(accelerate_config))
        except FileNotFoundError:  # reported among the run's path problems
            return None
    wanted = (int(num_processes or config.get("num_processes") or 1), config_engine(config) if config else None)
    running = (int(env.get("WORLD_SIZE", "1")), running_engine(env))
    if wanted[0] == running[0] and wanted[1] in (None, running[1]):
        return None
    asked = ", ".join(
        f"{key}: {value}"
        for key, value in (("accelerate_config", accelerate_config), ("num_processes", num_processes))
        if value
    )
    wanted_text = _processes(wanted[0]) + (f", {wanted[1]}" if wanted[1] else "")
    return (
        f"this launch runs {_processes(running[0])}, {running[1]}; the recipe's {asked} ({wanted_text}) apply through "
        f"`trl-longrm train {recipe}`, or pass them to accelerate launch (--config_file, --num_processes)"
    )
