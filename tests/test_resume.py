"""How a run starts (`trl_longrm.resume`): fresh, resumed from the newest complete checkpoint, or finished."""

import json

import pytest
import torch
from safetensors.torch import save_file

from trl_longrm.resume import clear_previous_run, newest_complete_checkpoint, plan_start
from trl_longrm.train import parse_args, start_plan


def save_checkpoint(directory, step, max_steps=6, optimizer=True, state=True):
    """A folder laid out as HF Trainer saves a checkpoint (weights, optimizer, trainer state written last)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.full((64,), float(step))}, str(directory / "model.safetensors"))
    if optimizer:
        torch.save({"state": torch.zeros(64)}, directory / "optimizer.pt")
    if state:
        (directory / "trainer_state.json").write_text(
            json.dumps({"global_step": step, "max_steps": max_steps, "num_train_epochs": 2})
        )
    return str(directory)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_no_output_dir_starts_fresh(tmp_path):
    start = plan_start(str(tmp_path / "run"), None, False, max_steps=6)
    assert (start.action, start.checkpoint) == ("fresh", None)


@pytest.mark.parametrize("resume", [None, True, "last", "true"])
def test_newest_checkpoint_is_resumed_by_default(tmp_path, resume):
    for step in (2, 10, 4):  # numeric order, not name order: checkpoint-10 is the newest
        save_checkpoint(tmp_path / f"checkpoint-{step}", step, max_steps=12)
    start = plan_start(str(tmp_path), resume, False, max_steps=12)
    assert (start.action, start.checkpoint, start.step) == ("resume", str(tmp_path / "checkpoint-10"), 10)
    assert start.describe() == f"Resuming from {tmp_path / 'checkpoint-10'} at step 10."


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda c: truncate(c / "model.safetensors"), "model.safetensors is unreadable"),
        (lambda c: truncate(c / "optimizer.pt"), "optimizer.pt is unreadable"),
        (lambda c: (c / "trainer_state.json").unlink(), "no readable trainer_state.json"),
        (lambda c: (c / "model.safetensors").unlink(), "no model weights"),
    ],
)
def test_damaged_newest_checkpoint_is_skipped_with_its_reason(tmp_path, damage, reason):
    save_checkpoint(tmp_path / "checkpoint-2", 2)
    save_checkpoint(tmp_path / "checkpoint-4", 4)
    damage(tmp_path / "checkpoint-4")
    start = plan_start(str(tmp_path), None, False, max_steps=6)
    assert (start.action, start.checkpoint, start.step) == ("resume", str(tmp_path / "checkpoint-2"), 2)
    [(skipped, why)] = start.skipped
    assert skipped == str(tmp_path / "checkpoint-4") and reason in why


def test_missing_shard_makes_a_checkpoint_damaged(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    save_checkpoint(checkpoint, 2)
    (checkpoint / "model.safetensors").rename(checkpoint / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    found, [(skipped, why)] = newest_complete_checkpoint(tmp_path)
    assert found is None and skipped == str(checkpoint) and "model-00002-of-00002.safetensors" in why


def test_finished_run_is_not_trained_again(tmp_path):
    save_checkpoint(tmp_path / "checkpoint-6", 6)
    save_checkpoint(tmp_path, 6, optimizer=False)  # the final model and state beside the checkpoints
    for resume in (None, "last", True):
        start = plan_start(str(tmp_path), resume, False, max_steps=6)
        assert (start.action, start.step) == ("finished", 6)
        assert str(tmp_path) in start.describe() and "--overwrite_output_dir" in start.describe()
    # Asked for more steps than it trained: it continues from its last checkpoint.
    more = plan_start(str(tmp_path), None, False, max_steps=10)
    assert (more.action, more.checkpoint) == ("resume", str(tmp_path / "checkpoint-6"))
    # A damaged final model is not a finished run.
    truncate(tmp_path / "model.safetensors")
    assert plan_start(str(tmp_path), None, False, max_steps=6).action == "resume"


def test_overwrite_starts_fresh_and_clears_the_earlier_run(tmp_path):
    save_checkpoint(tmp_path / "checkpoint-2", 2)
    save_checkpoint(tmp_path / "checkpoint-4", 4)
    save_checkpoint(tmp_path / "final", 6)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 6}))
    assert plan_start(str(tmp_path), None, True, max_steps=6).action == "fresh"
    removed = clear_previous_run(tmp_path)
    assert sorted(removed) == sorted(
        [str(tmp_path / "checkpoint-2"), str(tmp_path / "checkpoint-4"), str(tmp_path / "trainer_state.json")]
    )
    assert (tmp_path / "final").is_dir()  # not the Trainer's: left alone
    assert plan_start(str(tmp_path), None, False, max_steps=6).action == "fresh"


def test_explicit_checkpoint_and_false(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoint-2", 2)
    assert plan_start(str(tmp_path), path, False, max_steps=6).checkpoint == path
    with pytest.raises(ValueError, match="no such folder"):
        plan_start(str(tmp_path), str(tmp_path / "checkpoint-9"), False)
    truncate(tmp_path / "checkpoint-2" / "model.safetensors")
    with pytest.raises(ValueError, match="checkpoint-2.*model.safetensors is unreadable"):
        plan_start(str(tmp_path), path, False)
    with pytest.raises(ValueError, match="--overwrite_output_dir"):
        plan_start(str(tmp_path), False, False)
    assert plan_start(str(tmp_path / "empty"), "false", False).action == "fresh"


def test_recipe_resume_from_checkpoint_true_on_a_first_run(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"stage: sft\nmodel_name_or_path: m\ndataset_name: d.jsonl\noutput_dir: {tmp_path / 'run'}\n"
        "use_cpu: true\nbf16: false\nresume_from_checkpoint: true\n"
    )
    script, args, _ = parse_args([str(recipe)])
    assert start_plan(script, args).action == "fresh"
    save_checkpoint(tmp_path / "run" / "checkpoint-3", 3)
    assert start_plan(script, args).checkpoint == str(tmp_path / "run" / "checkpoint-3")
    script, args, _ = parse_args([str(recipe), "--overwrite_output_dir", "true"])
    assert start_plan(script, args).action == "fresh"
