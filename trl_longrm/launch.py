"""Launch settings of a recipe: the accelerate config and process count it names (`accelerate_config`,
`num_processes`, overridable by the flags after the recipe), and where that config lies.

`trl_longrm.cli` launches with these settings and `trl_longrm.train` checks them in every process; both import them
from here, and this module imports neither.
"""

from __future__ import annotations

from pathlib import Path


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
