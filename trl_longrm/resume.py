"""How a training run starts: afresh, from the newest complete checkpoint in `output_dir`, or not at all (finished).

The same command starts and resumes a run: HF Trainer's `checkpoint-N` folders are found with transformers'
`sort_checkpoints`, and a folder whose files a kill left unfinished (no `trainer_state.json`, which the Trainer
writes last, or a truncated weights/optimizer file) is skipped with a warning naming it.

Example:
```python
>>> start = plan_start("runs/sft", resume_from_checkpoint=None, overwrite_output_dir=False, max_steps=100)
>>> start.action, start.checkpoint, start.step
('resume', 'runs/sft/checkpoint-40', 40)
```
"""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path


TRAINER_STATE = "trainer_state.json"
# Files torch writes as zip archives (`torch.save`): a truncated one has no central directory at its end.
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
AUTO = ("last", "true", "auto")


@dataclass
class StartPlan:
    """What the run does: `action` is `"fresh"`, `"resume"` (from `checkpoint`, at `step`) or `"finished"` (the
    final model is in `output_dir`); `skipped` lists `(checkpoint, reason)` for damaged checkpoints passed over."""

    action: str
    output_dir: str
    checkpoint: str | None = None
    step: int | None = None
    max_steps: int | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def describe(self) -> str:
        """The one line a run prints about how it starts."""
        if self.action == "finished":
            of = f" of {self.max_steps}" if self.max_steps else ""
            return (
                f"{self.output_dir} already holds the final model of a finished run (step {self.step}{of}); nothing "
                "to train. Pass --overwrite_output_dir true to train again from the start."
            )
        if self.action == "resume":
            return f"Resuming from {self.checkpoint} at step {self.step}."
        return f"Starting a new run in {self.output_dir}."


def _torch_file_problem(path: Path) -> str | None:
    try:
        zipfile.ZipFile(path).close()
    except (zipfile.BadZipFile, OSError) as error:
        return f"{path.name} is unreadable ({error}; truncated?)"
    return None


def _safetensors_problem(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        # Reads the header only; it fails when the header's tensors do not exactly cover the file (truncation).
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as error:  # SafetensorError, or an OSError for an unreadable file
        return f"{path.name} is unreadable ({error})"
    return None


def weights_problem(directory: str | Path, recursive: bool = True) -> str | None:
    """Why the model weights saved in `directory` cannot be loaded (none, truncated, a missing shard), else None.

    Checks headers and archive directories only (cheap for multi-GB files); `recursive` also looks into sub-folders
    (DeepSpeed's `global_stepN/`)."""
    directory = Path(directory)
    files = sorted(directory.rglob("*") if recursive else directory.iterdir())
    weights = [f for f in files if f.is_file() and f.suffix in (".safetensors", *TORCH_SUFFIXES)]
    if not any(f.suffix in (".safetensors", ".bin") for f in weights) and not any(
        f.is_dir() and f.name.startswith("global_step") for f in files
    ):
        return "no model weights in it"
    for index in (f for f in files if f.name.endswith(".index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError) as error:
            return f"{index.name} is unreadable ({error})"
        missing = sorted(s for s in shards if not (index.parent / s).is_file())
        if missing:
            return f"{index.name} lists missing shards {missing}"
    for path in weights:
        problem = _safetensors_problem(path) if path.suffix == ".safetensors" else _torch_file_problem(path)
        if problem:
            return problem
    return None


def read_state(directory: str | Path) -> dict | None:
    """The `trainer_state.json` saved in `directory`, or None where it is absent or unreadable."""
    try:
        state = json.loads((Path(directory) / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("global_step"), int) else None


def checkpoint_problem(checkpoint: str | Path) -> str | None:
    """Why `checkpoint` (a `checkpoint-N` folder) cannot be resumed from, else None."""
    if read_state(checkpoint) is None:
        # The Trainer writes trainer_state.json after the weights, optimizer, scheduler and RNG states.
        return f"no readable {TRAINER_STATE} (the save was interrupted)"
    return weights_problem(checkpoint)


def newest_complete_checkpoint(output_dir: str | Path) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest `checkpoint-N` in `output_dir` that can be resumed from, and the newer ones skipped (path, why)."""
    from transformers.trainer_utils import sort_checkpoints

    skipped = []
    if Path(output_dir).is_dir():
        for checkpoint in reversed(sort_checkpoints(str(output_dir))):
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                return checkpoint, skipped
            skipped.append((checkpoint, problem))
    return None, skipped


def final_model_state(output_dir: str | Path) -> dict | None:
    """The trainer state of a run that finished and saved its final model in `output_dir`, else None."""
    state = read_state(output_dir)  # written beside the final model after training, never during it
    if state is None or weights_problem(output_dir, recursive=False) is not None:
        return None
    return state


def plan_start(
    output_dir: str,
    resume_from_checkpoint: str | bool | None,
    overwrite_output_dir: bool,
    max_steps: int = -1,
    num_train_epochs: float | None = None,
) -> StartPlan:
    """Decide how a run with these arguments starts (see the module docstring); reads `output_dir`, changes nothing.

    `resume_from_checkpoint` is None, True or `"last"` (the newest complete checkpoint, if any: the default), a
    checkpoint path (that one), or False (start afresh, refused where checkpoints would be mixed with the new run's).
    A finished run asked for more steps (`max_steps`) or epochs than it trained resumes from its newest checkpoint.
    """
    if overwrite_output_dir:
        return StartPlan("fresh", output_dir)
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("false", "no", "none"):
        resume_from_checkpoint = False
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() not in AUTO:
        problem = (
            checkpoint_problem(resume_from_checkpoint)
            if Path(resume_from_checkpoint).is_dir()
            else f"no such folder (resolved against {Path.cwd()})"
        )
        if problem:
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r} cannot be resumed from: {problem}.")
        return StartPlan(
            "resume", output_dir, resume_from_checkpoint, read_state(resume_from_checkpoint)["global_step"]
        )
    checkpoint, skipped = newest_complete_checkpoint(output_dir)
    if resume_from_checkpoint is False:
        if checkpoint or skipped:
            raise ValueError(
                f"resume_from_checkpoint is false but {output_dir} holds checkpoints of an earlier run; pass "
                "--overwrite_output_dir true to delete them and start afresh, or leave resume_from_checkpoint unset "
                "to resume."
            )
        return StartPlan("fresh", output_dir)
    final = final_model_state(output_dir)
    if final is not None:
        more_steps = max_steps is not None and max_steps > final["global_step"]
        more_epochs = (max_steps is None or max_steps <= 0) and (num_train_epochs or 0) > final.get(
            "num_train_epochs", 0
        )
        if not (more_steps or more_epochs) or checkpoint is None:
            return StartPlan("finished", output_dir, step=final["global_step"], max_steps=final.get("max_steps"))
    if checkpoint is None:
        return StartPlan("fresh", output_dir, skipped=skipped)
    return StartPlan("resume", output_dir, checkpoint, read_state(checkpoint)["global_step"], skipped=skipped)


def clear_previous_run(output_dir: str | Path) -> list[str]:
    """Delete what an earlier run left that a new run would mix with its own (its `checkpoint-N` folders and final
    trainer state), so that a later resume never picks the old run's checkpoint. Returns what it removed."""
    from transformers.trainer_utils import sort_checkpoints

    removed = []
    if not Path(output_dir).is_dir():
        return removed
    for checkpoint in sort_checkpoints(str(output_dir)):
        shutil.rmtree(checkpoint)
        removed.append(checkpoint)
    state = Path(output_dir) / TRAINER_STATE
    if state.is_file():
        state.unlink()
        removed.append(str(state))
    return removed
