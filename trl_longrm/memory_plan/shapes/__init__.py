"""Model shapes bundled with the package: the `config.json` files of Qwen3-8B and Llama-3.1-8B, named by file stem.
What the recipes' dry runs (`model_config: qwen3-8b`) and `trl-longrm plan --model qwen3-8b` plan, in a checkout and a
pip install alike (nothing is downloaded: the plan traces fake weights of the shape).

Example:
```python
>>> from trl_longrm.memory_plan.shapes import bundled_shapes, model_config_file
>>> bundled_shapes()
['llama-3.1-8b', 'qwen3-8b']
>>> model_config_file("qwen3-8b").name
'qwen3-8b.json'
```
"""

from __future__ import annotations

from pathlib import Path


SHAPES = Path(__file__).resolve().parent


def bundled_shapes() -> list[str]:
    """The names of the bundled shapes."""
    return sorted(path.stem for path in SHAPES.glob("*.json"))


def model_config_file(model) -> Path:
    """The `config.json` `model` names: a file, a folder holding one, or a bundled shape's name."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.exists() and (SHAPES / f"{model}.json").is_file():
        path = SHAPES / f"{model}.json"
    return path
