"""`accelerate launch recipes/<recipe>.yaml`: every training recipe's first line declares the `trl_longrm` source
encoding, which the installed `trl_longrm.pth` registers, so that Python runs the recipe as `python -m trl_longrm
recipe.yaml ARGS` does (see `trl_longrm.recipe_codec`)."""

import codecs
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from trainer_helpers import write_longrm_jsonl

from trl_longrm.launch import RECIPE_FIRST_LINE, launch_mismatch, runs_under_accelerate_launch
from trl_longrm.recipe_codec import PROGRAM, IncrementalDecoder, search
from trl_longrm.testing_utils import save_tiny_model


ROOT = Path(__file__).resolve().parents[1]
# Training recipes name a `stage`; the other YAML files under recipes/ are judge prompt templates (`trl-longrm eval
# --prompt-template`), not programs.
TRAINING_RECIPES = sorted(
    path.relative_to(ROOT).as_posix()
    for path in (ROOT / "recipes").rglob("*.yaml")
    if "stage" in (yaml.safe_load(path.read_text(encoding="utf-8")) or {})
)


def test_the_training_recipes_are_the_paper_low_memory_and_tiny_ones():
    names = {Path(recipe).name for recipe in TRAINING_RECIPES}
    assert len(TRAINING_RECIPES) == 15 and sum(recipe.startswith("recipes/tiny/") for recipe in TRAINING_RECIPES) == 3
    assert {"sft.yaml", "simpo_grm.yaml", "simpo_disrm.yaml", "simpo_grm_qlora.yaml"} <= names
    assert {"sft_1m.yaml", "simpo_grm_1m.yaml", "simpo_disrm_1m.yaml"} <= names  # activation offload + tiled MLP


@pytest.fixture
def recipe_codec():
    codecs.register(search)
    yield
    codecs.unregister(search)


@pytest.mark.parametrize("recipe", TRAINING_RECIPES)
def test_every_training_recipe_is_a_program_that_runs_itself(recipe, recipe_codec):
    source = (ROOT / recipe).read_bytes()
    assert source.decode("utf-8").startswith(RECIPE_FIRST_LINE + " ") and runs_under_accelerate_launch(ROOT / recipe)
    # As Python reads it (a whole file, as `compile` and `runpy` do): the recipe's lines as comments, then the one
    # statement that runs it.
    text = source.decode("trl_longrm")
    lines = text.splitlines(keepends=True)
    assert all(line.startswith("#") or not line.strip() for line in lines[:-1]) and lines[-1] == PROGRAM
    assert len(lines) == len(source.decode("utf-8").splitlines()) + 1
    compile(source, recipe, "exec")
    # Fed a byte at a time, from the middle of the first line on (where Python's tokenizer hands the file over
    # once it has read the coding line itself): the same program.
    decoder = IncrementalDecoder()
    start = source.index(b"\n") - 1
    fed = "".join(decoder.decode(source[i : i + 1]) for i in range(start, len(source))) + decoder.decode(b"", True)
    assert fed.splitlines()[1:] == [line.rstrip("\n") for line in lines[1:]]
    assert decoder.decode(b"", final=True) == ""  # a reader at the end of the file asks again: end of file


def test_dry_run_notes_a_recipe_that_lost_its_first_line(tmp_path, capsys):
    from trl_longrm.train import main

    edited = tmp_path / "sft.yaml"
    edited.write_text((ROOT / "recipes/tiny/sft.yaml").read_text(encoding="utf-8").split("\n", 1)[1])
    for recipe, noted in ((ROOT / "recipes/tiny/sft.yaml", False), (edited, True)):
        assert main([str(recipe), "--dry_run", "--output_dir", str(tmp_path / "o")]) in (0, 1)
        note = f"note: {recipe}: its first line is not `{RECIPE_FIRST_LINE}`"
        assert (note in capsys.readouterr().err) == noted


def test_a_launch_that_differs_from_the_recipes_settings_is_one_note():
    disrm, grm = str(ROOT / "recipes/tiny/simpo_disrm.yaml"), str(ROOT / "recipes/simpo_grm.yaml")
    # recipes/tiny/simpo_disrm.yaml: cpu_ddp.yaml (plain DDP), 2 processes; simpo_grm.yaml: zero2.yaml, 8 processes.
    assert launch_mismatch(disrm, [], {"WORLD_SIZE": "2"}) is None
    assert launch_mismatch(disrm, ["--num_processes", "1"], {}) is None  # flags after the recipe count
    deepspeed = {"WORLD_SIZE": "8", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    assert launch_mismatch(grm, [], deepspeed) is None
    assert launch_mismatch(grm, [], {**deepspeed, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}) == (
        "this launch runs 8 processes, DeepSpeed ZeRO-3; the recipe's accelerate_config: zero2.yaml, num_processes: 8 "
        f"(8 processes, DeepSpeed ZeRO-2) apply through `trl-longrm train {grm}`, or pass them to accelerate launch "
        "(--config_file, --num_processes)"
    )
    note = launch_mismatch(disrm, [], {})
    assert note.startswith("this launch runs 1 process, no DeepSpeed or FSDP; the recipe's accelerate_config: ")
    assert "\n" not in note


# ---------------------------------------------------------------- `accelerate launch RECIPE` as installed (slow)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A Python environment with this checkout installed as `pip install -e .` installs it (its `trl_longrm.pth`
    included), seeing this environment's other packages: the recipe runs as it runs for a user."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # This environment's packages as a plain path: its own editable `trl_longrm` (a .pth finder) does not apply.
    Path(purelib, "_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-build-isolation",
         "-e", str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    return {"python": str(python), "pth": Path(purelib, "trl_longrm.pth")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "lm": save_tiny_model(root / "lm", arch="qwen3", task="causal-lm", seed=1),
        "sft": write_longrm_jsonl(root / "sft.jsonl", 8, sft=True),
    }


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def accelerate_launch(python, *args):
    """`accelerate launch ARGS` in the environment of `python` (the `accelerate` command is this module's CLI)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the package as installed, not as this test process imports it
    command = [python, "-m", "accelerate.commands.accelerate_cli", "launch", *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def weights(directory):
    return load_file(str(Path(directory) / "model.safetensors"))


@pytest.mark.slow
def test_accelerate_launch_recipe_on_one_and_two_processes(installed, tiny, tmp_path):
    import torch

    args = ["--model_name_or_path", tiny["lm"], "--dataset_name", tiny["sft"], "--max_steps", "2"]
    args += ["--learning_rate", "1e-3"]  # flags after the recipe override its values (its 1 step: --max_steps 2)
    one = accelerate_launch(
        installed["python"], "--cpu", "--num_processes", "1", "recipes/tiny/sft.yaml",
        *args, "--output_dir", str(tmp_path / "one"),
    )  # fmt: skip
    # The reference: the same run as `trl-longrm train` launches it (`accelerate launch -m trl_longrm RECIPE`), its one
    # process run in this one under the variables accelerate gives it, with the launches' one thread.
    from unittest import mock

    from trl_longrm.cli import run_train_in_this_process

    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}):
        code = run_train_in_this_process(str(ROOT / "recipes/tiny/sft.yaml"), [*args, "--output_dir",
                                                                                str(tmp_path / "reference")])
    assert code == 0
    for name, tensor in weights(tmp_path / "reference").items():
        torch.testing.assert_close(weights(tmp_path / "one")[name], tensor, rtol=0, atol=0, msg=name)
    assert json.loads((tmp_path / "one" / "trainer_state.json").read_text())["global_step"] == 2
    assert "note: this launch runs" not in one.stderr  # the recipe's cpu_single.yaml, 1 process: as launched

    # accelerate's own flags decide the processes: two, over gloo, where the recipe asks for one (one note, rank 0).
    two = accelerate_launch(
        installed["python"], "--config_file", "accelerate_configs/cpu_ddp.yaml", "--main_process_port", free_port(),
        "recipes/tiny/sft.yaml", *args, "--output_dir", str(tmp_path / "two"),
    )  # fmt: skip
    # (torchrun hands its processes the recipe's absolute path)
    notes = [line.replace(f"{ROOT}/", "") for line in two.stderr.splitlines() if line.startswith("note: this launch")]
    assert notes == [
        "note: this launch runs 2 processes, no DeepSpeed or FSDP; the recipe's accelerate_config: cpu_single.yaml, "
        "num_processes: 1 (1 process, no DeepSpeed or FSDP) apply through `trl-longrm train recipes/tiny/sft.yaml`, "
        "or pass them to accelerate launch (--config_file, --num_processes)"
    ], two.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "trainer_state.json").read_text())["global_step"] == 2


@pytest.mark.slow
def test_a_wheel_installs_the_same_pth_as_an_editable_install(installed, tmp_path):
    # Built from a copy of the tracked files, so that the checkout gets no build/ folder.
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(listed, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    source = tmp_path / "src"
    for name in tracked.splitlines():
        if not (ROOT / name).is_file():  # deleted in the working tree
            continue
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("trl_longrm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("trl_longrm.pth") == installed["pth"].read_bytes()
        record = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))).decode()
    assert "\ntrl_longrm.pth," in "\n" + record  # so that `pip uninstall` removes it
    assert installed["pth"].read_text().startswith("import ")  # site runs it at interpreter start
