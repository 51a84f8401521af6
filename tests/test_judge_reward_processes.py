"""`JudgeReward` under several processes: a real GRPO (and RLOO) step on 2 processes (gloo, CPU) rewarded by a judge
on a real vLLM server whose verdicts depend on the responses it reads (`judge_steering`): every group is judged whole,
whatever `per_device_train_batch_size` and `num_generations` split it into, and the rewards the trainer gathers are
those of one process on the same rows (TRL's own `_calculate_rewards` here) and of the judging rule by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_support import VLLM_SHAPE, vllm_server


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import judge_steering  # noqa: E402
from judge_reward_worker import CASES, trainer_for  # noqa: E402

from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model  # noqa: E402


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge_processes")
    tokenizer = build_chat_tokenizer()
    return {
        "judge": str(save_tiny_model(root / "judge", arch="qwen3", tokenizer=tokenizer, seed=3, **VLLM_SHAPE)),
        "policy": str(save_tiny_model(root / "policy", tokenizer=tokenizer, seed=6)),
        "root": root,
    }


@pytest.fixture(scope="module")
def server(paths):
    steering = ["--logits-processors", "judge_steering:SteeredVerdicts"]
    with vllm_server(paths["judge"], "--enable-prefix-caching", *steering, served_model_name="judge",
                     env={"PYTHONPATH": str(ROOT / "tests")}) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def two_processes(paths, server):
    """Every case's step on 2 processes, from one launch."""
    out = paths["root"] / "two_processes.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"), "--num_processes", "2", "--main_process_port", "0",
               str(ROOT / "tests" / "judge_reward_worker.py"), "--base-url", server.base_url, "--judge",
               paths["judge"], "--policy", paths["policy"], "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(out.read_text())


def completion_texts(completions):
    return [c if isinstance(c, str) else c[0]["content"] for c in completions]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_two_processes_equal_one_and_the_rule_by_hand(two_processes, paths, server, tmp_path, case):
    name, kind, protocol, per_device, generations = case
    run = two_processes[name]
    prompts, completions, rewards = run["prompts"], run["completions"], run["rewards"]
    assert run["num_processes"] == 2
    assert len(prompts) == 2 * per_device  # the step's rows, gathered by the trainer from both processes
    # The groups (equal prompts), each split as the trainer dealt it: some group has rows on both processes.
    groups = {}
    for row, prompt in enumerate(prompts):
        groups.setdefault(json.dumps(prompt), []).append(row)
    assert all(len(rows) == generations for rows in groups.values())
    assert any(rows[0] < per_device <= rows[-1] for rows in groups.values())

    # By hand: the judging rule on each whole group.
    texts = completion_texts(completions)
    expected = [None] * len(prompts)
    for rows in groups.values():
        rule = judge_steering.expected_pairwise if protocol == "pairwise" else judge_steering.expected_ranking
        for row, value in zip(rows, rule([texts[r] for r in rows])):
            expected[row] = value
    assert rewards == pytest.approx(expected)
    assert len({r for r in rewards if r is not None}) > 1  # verdicts differ between completions

    # One process, TRL's own `_calculate_rewards` on the same rows: the same rewards (None -> NaN).
    trainer = trainer_for(kind, protocol, 2 * per_device, generations, paths, server.base_url, str(tmp_path / "one"))
    one = trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, [[0]] * len(prompts))
    torch.testing.assert_close(one[:, 0], torch.tensor([float("nan") if r is None else r for r in rewards]),
                               equal_nan=True)  # fmt: skip
    # The counters the user reads are the whole batch's, as one process logs them.
    for key, values in trainer._pending_metrics.items():
        assert run["metrics"][key] == pytest.approx(values[0]), key
    assert run["metrics"]["judge/unscored_rows"] == sum(r is None for r in rewards)
