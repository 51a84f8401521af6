"""Two data-parallel replicas (gloo, CPU) with packing and 1-4 rejected responses per group: training does not crash
on ranks holding different numbers of groups, and every logged metric equals a hand computation over the groups of
its step (each once: the row accelerate repeats to even out the last batch of an epoch is not counted)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from dp_metrics_worker import STEPS, build  # noqa: E402


def _group_values(trainer, kind, pack):
    """Per-group reference values of one packed row, from a single-process forward."""
    batch = trainer._prepare_inputs(trainer.data_collator([pack]))
    with torch.no_grad():
        if kind == "disrm":
            per_sequence = trainer.sequence_scores(trainer.model, batch)
            tokens = None
        else:
            sums, counts = trainer.sequence_logps(trainer.model, batch)
            per_sequence, tokens = sums / counts, (sums, counts)
    groups = {}
    for s, (g, r) in enumerate(zip(batch["group_index"].tolist(), batch["response_index"].tolist())):
        entry = groups.setdefault(g, {"chosen": None, "rejected": [], "nll": 0.0, "tokens": 0.0})
        if r == 0:
            entry["chosen"] = per_sequence[s].item()
            if tokens is not None:
                entry["nll"], entry["tokens"] = -tokens[0][s].item(), tokens[1][s].item()
        else:
            entry["rejected"].append(per_sequence[s].item())
    return [groups[g] for g in sorted(groups)]


def _mean(values):
    return sum(values) / len(values)


def _expected(kind, groups, beta):
    if kind == "disrm":
        scores = [v for g in groups for v in [g["chosen"], *g["rejected"]]]
        return {
            "accuracy": _mean([float(g["chosen"] > _mean(g["rejected"])) for g in groups]),
            "accuracy_vs_all": _mean([float(g["chosen"] > max(g["rejected"])) for g in groups]),
            "margin": _mean([g["chosen"] - _mean(g["rejected"]) for g in groups]),
            "mean_reward": _mean(scores),
            "min_reward": min(scores),
            "max_reward": max(scores),
        }
    chosen = [beta * g["chosen"] for g in groups]
    rejected = [beta * _mean(g["rejected"]) for g in groups]
    return {
        "rewards/chosen": _mean(chosen),
        "rewards/rejected": _mean(rejected),
        "rewards/accuracies": _mean([float(c > r) for c, r in zip(chosen, rejected)]),
        "rewards/accuracies_vs_all": _mean([float(g["chosen"] > max(g["rejected"])) for g in groups]),
        "rewards/margins": _mean([c - r for c, r in zip(chosen, rejected)]),
        "logps/chosen": _mean([g["chosen"] for g in groups]),
        "logps/rejected": _mean([v for g in groups for v in g["rejected"]]),
        "nll_loss": sum(g["nll"] for g in groups) / sum(g["tokens"] for g in groups),
    }


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    """Both kinds trained by one launch of two data-parallel replicas; the folder holding `grm.json`, `disrm.json`."""
    out_dir = tmp_path_factory.mktemp("two_replicas")
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        "0",
        str(ROOT / "tests" / "dp_metrics_worker.py"),
        "--out_dir",
        str(out_dir),
        "--kind",
        "grm",
        "disrm",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grm", "disrm"])
def test_two_replicas_log_every_group_once(two_replicas, tmp_path, kind):
    out = json.loads((two_replicas / f"{kind}.json").read_text())
    packs = out["packs"]
    assert out["num_processes"] == 2 and len(packs) % 2 == 1
    assert {len(g) for p in packs for g in p["rejected_completion_ids"]} == {1, 2, 3, 4}

    reference = build(kind, str(tmp_path / "reference"))
    values = [_group_values(reference, kind, pack) for pack in packs]
    beta = getattr(reference.args, "beta", None)
    # Sequential sampling, one row per replica and step: step s of an epoch holds rows 2s and 2s + 1; the epoch's
    # last step has row P - 1 and a repeat of row 0, which must not count.
    steps_per_epoch = math.ceil(len(packs) / 2)

    def rows_of(step):
        first = 2 * (step % steps_per_epoch)
        return [r for r in (first, first + 1) if r < len(packs)]

    logs = [h for h in out["log_history"] if "loss" in h and "eval_loss" not in h and "train_runtime" not in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    for step, log in enumerate(logs):
        expected = _expected(kind, [g for r in rows_of(step) for g in values[r]], beta)
        for name, value in expected.items():
            assert log[name] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, name)

    # Evaluation: the mean over its steps of each step's value, the last step over its one real row.
    per_step = [_expected(kind, [g for r in rows_of(s) for g in values[r]], beta) for s in range(steps_per_epoch)]
    for name in per_step[0]:
        assert out["eval"][f"eval_{name}"] == pytest.approx(_mean([m[name] for m in per_step]), rel=1e-4, abs=1e-5), name
