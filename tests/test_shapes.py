"""The model shapes bundled with the package (`trl_longrm.memory_plan.shapes`): named by `trl-longrm plan --model` and
the recipes' `model_config`, and shipped in the wheel, so a pip install plans them as a checkout does."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from trl_longrm.memory_plan.command import resolve_model_config
from trl_longrm.memory_plan.plan import load_model_config
from trl_longrm.memory_plan.shapes import bundled_shapes, model_config_file


ROOT = Path(__file__).resolve().parents[1]


def test_shapes_resolve_by_name_and_load():
    assert bundled_shapes() == ["llama-3.1-8b", "qwen3-8b"]
    assert resolve_model_config("qwen3-8b") == model_config_file("qwen3-8b")
    qwen, llama = load_model_config("qwen3-8b"), load_model_config("llama-3.1-8b")
    assert (qwen.model_type, qwen.num_hidden_layers, qwen.hidden_size) == ("qwen3", 36, 4096)
    assert (llama.model_type, llama.num_hidden_layers, llama.rope_scaling["rope_type"]) == ("llama", 32, "llama3")
    with pytest.raises(SystemExit, match="bundled shape: llama-3.1-8b, qwen3-8b"):
        resolve_model_config("qwen3-9b")


def test_every_recipe_names_a_shape_that_resolves():
    named = {}
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        value = (yaml.safe_load(recipe.read_text()) or {}).get("model_config")
        if value is not None:
            named[recipe.name] = value
            assert model_config_file(value).is_file(), (recipe.name, value)
    assert set(named.values()) == set(bundled_shapes()), named


def test_the_wheel_ships_the_shapes(tmp_path):
    """The wheel built from this checkout's sources holds every bundled shape (`package-data` in pyproject.toml). The
    sources are copied first: setuptools writes `build/` and the egg-info beside what it builds."""
    source = tmp_path / "source"
    shutil.copytree(ROOT / "trl_longrm", source / "trl_longrm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        capture_output=True, text=True, cwd=source,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("trl_longrm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shape in bundled_shapes():
        assert f"trl_longrm/memory_plan/shapes/{shape}.json" in names
