"""verl (0.9.1) and OpenRLHF (0.11.2) rewarded by our judge the way their current releases call it: verl's
`RewardLoopWorker` (its own code, from its wheel) loading `trl_longrm.rewards.verl.JudgeRewardManager` by module and
scoring sample by sample on workers picked at random, and OpenRLHF's `SingleTurnAgentExecutor` posting each sample to
`trl-longrm reward-server`. The judge is a real vLLM server whose verdicts depend on the responses (`judge_steering`):
every group is judged whole (the expected pairwise win rates by hand), though no call holds more than one sample.
The per-sample routes (verl's `compute_score` in its `naive` manager, OpenRLHF's `.py` `reward_func`) judge
pointwise, and refuse a pairwise judge with an error that reaches the user through OpenRLHF's catch-all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_support import VLLM_SHAPE, require_vllm, run_in_vllm_venv, vllm_server


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import judge_steering  # noqa: E402

from trl_longrm.serving.server import free_port  # noqa: E402
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model  # noqa: E402


pytestmark = pytest.mark.slow
G = 4
PROMPTS = [[{"role": "user", "content": "Name a river."}], [{"role": "user", "content": "Name a city and a colour."}]]
RESPONSES = [["The Nile.", "Amazon, I think", "the Danube river", "Rhine"],
             ["Paris, blue.", "Rome and red", "Lima green", "Oslo; white"]]  # fmt: skip
WORKER = ROOT / "tests" / "rl_frameworks_worker.py"


def require_frameworks():
    python = require_vllm()
    found = subprocess.run([str(python), "-c", "import verl, openrlhf"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip(f"verl and OpenRLHF are not in vLLM's venv (`make vllm` installs them): {found.stderr[-300:]}")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_frameworks")
    tokenizer = build_chat_tokenizer()
    samples = root / "samples.json"
    samples.write_text(json.dumps({"prompts": PROMPTS, "responses": RESPONSES}))
    return {
        "judge": str(save_tiny_model(root / "judge", arch="qwen3", tokenizer=tokenizer, seed=3, **VLLM_SHAPE)),
        "policy": str(save_tiny_model(root / "policy", tokenizer=tokenizer, seed=6)),
        "samples": str(samples),
        "root": root,
    }


@pytest.fixture(scope="module")
def judge_server(paths):
    require_frameworks()
    with vllm_server(paths["judge"], "--enable-prefix-caching", "--logits-processors",
                     "judge_steering:SteeredVerdicts", served_model_name="judge",
                     env={"PYTHONPATH": str(ROOT / "tests")}) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def reward_server(paths, judge_server):
    """`trl-longrm reward-server`, pairwise, groups of G."""
    port = free_port()
    log = open(paths["root"] / "reward_server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "trl_longrm", "reward-server", "--base-url", judge_server.base_url, "--served-model",
         "judge", "--tokenizer", paths["judge"], "--protocol", "pairwise", "--group-size", str(G), "--port", str(port),
         "--max-length", "2048", "--max-new-tokens", "16", "--group-timeout", "120"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if process.poll() is not None:
                raise AssertionError((paths["root"] / "reward_server.log").read_text()[-3000:]) from None
            time.sleep(1)
    yield url
    process.terminate()
    process.wait(timeout=30)
    log.close()


def expected_rewards():
    return [judge_steering.expected_pairwise(responses) for responses in RESPONSES]


def judge_env(paths, judge_server, protocol):
    return {"TRL_LONGRM_JUDGE_URL": judge_server.base_url, "TRL_LONGRM_JUDGE_MODEL": "judge",
            "TRL_LONGRM_JUDGE_TOKENIZER": paths["judge"], "TRL_LONGRM_JUDGE_PROTOCOL": protocol,
            "TRL_LONGRM_JUDGE_MAX_LENGTH": "2048", "TRL_LONGRM_JUDGE_MAX_NEW_TOKENS": "16",
            "TRL_LONGRM_JUDGE_VERDICT_PROBS": "0"}  # fmt: skip


# A real step's scale: 512 prompts x 8 samples, judged by ranking (one judge request a group) on a stand-in judge of
# known verdicts and a fixed latency (tests/judge_stand_in.py).
SCALE_PROMPTS, SCALE_G, OPENRLHF_MAX_LEN = 512, 8, 128


def scale_samples() -> dict:
    prompts = [[{"role": "user", "content": f"Question {i}: which river runs by city {i}? " + "Context word. " * 40}]
               for i in range(SCALE_PROMPTS)]  # fmt: skip
    responses = [[f"City {i} river {j}: " + "the answer " * (1 + (i + j) % 5) for j in range(SCALE_G)]
                 for i in range(SCALE_PROMPTS)]  # fmt: skip
    return {"prompts": prompts, "responses": responses}


@pytest.fixture(scope="module")
def scale_server(paths):
    """`trl-longrm reward-server --protocol ranking --group-size 8` on the stand-in judge (20 ms a request)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from reward_server_helpers import judge_process, server_process

    with judge_process(paths["judge"], latency=0.02) as (judge_url, _):
        with server_process(judge_url, paths["judge"], "--protocol", "ranking", "--group-size", str(SCALE_G),
                            "--max-concurrency", "64", "--max-new-tokens", "64", "--log-level", "warning",
                            log_path=paths["root"] / "scale_server.log") as (_, url, log):  # fmt: skip
            yield url, log


@pytest.fixture(scope="module")
def runs(paths, judge_server, reward_server, scale_server):
    """Every job in one process of vLLM's venv (importing verl and OpenRLHF takes longer than the jobs)."""
    per_sample = str(ROOT / "trl_longrm" / "rewards" / "openrlhf.py")
    scale_file = paths["root"] / "scale_samples.json"
    scale_file.write_text(json.dumps(scale_samples()))
    scale_url, _ = scale_server
    jobs = [
        {"name": "verl_scale", "kind": "verl-scale", "env": {"TRL_LONGRM_REWARD_SERVER": scale_url},
         "samples": str(scale_file)},
        {"name": "openrlhf_scale", "kind": "openrlhf-scale", "remote": f"{scale_url}/get_reward",
         "samples": str(scale_file), "max_length": OPENRLHF_MAX_LEN},
        {"name": "verl_slots", "kind": "verl-slots", "env": {"TRL_LONGRM_REWARD_SERVER": scale_url}},
        {"name": "verl_manager", "kind": "verl-manager", "env": {"TRL_LONGRM_REWARD_SERVER": reward_server}},
        {"name": "openrlhf_server", "kind": "openrlhf", "remote": f"{reward_server}/get_reward"},
        {"name": "verl_function", "kind": "verl-function", "env": judge_env(paths, judge_server, "pointwise")},
        {"name": "openrlhf_file", "kind": "openrlhf", "remote": per_sample,
         "env": judge_env(paths, judge_server, "pointwise")},
        # Last: a pairwise judge on the per-sample file route, refused.
        {"name": "openrlhf_file_pairwise", "kind": "openrlhf", "remote": per_sample,
         "env": judge_env(paths, judge_server, "pairwise")},
    ]  # fmt: skip
    jobs_file = paths["root"] / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    run = run_in_vllm_venv(WORKER, str(jobs_file), paths["policy"], paths["samples"], timeout=1200)
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    return {"results": json.loads(line[len("RESULT ") :]), "stderr": run.stderr}


def test_expected_rewards_differ():
    flat = [r for group in expected_rewards() for r in group]
    assert None not in flat and len(set(flat)) > 2


def test_verl_reward_loop_judges_uid_groups_whole(runs):
    """verl's own `RewardLoopWorker`: every sample alone on a random worker, and the batch in chunks of 3 (groups of 4
    split over the workers): the pairwise win rates of the whole groups."""
    result = runs["results"]["verl_manager"]
    expected = [r for group in expected_rewards() for r in group]
    assert result["streamed"] == pytest.approx(expected)
    assert result["batched"] == pytest.approx(expected)
    assert all(extra["judge_unscored"] == 0 for extra in result["extra"])


def test_openrlhf_executor_gets_group_rewards_from_the_reward_server(runs):
    """OpenRLHF's `SingleTurnAgentExecutor` posts each sample to the reward server (`--reward.remote_url`): each gets
    its whole group's pairwise win rate, as scalars OpenRLHF reads."""
    for got, expected in zip(runs["results"]["openrlhf_server"]["rewards"], expected_rewards()):
        assert [sample["reward"] for sample in got] == pytest.approx(expected)
        assert [sample["scores"] for sample in got] == pytest.approx(expected)  # already in [0, 1]
        assert [sample["extra_logs"]["judge/unscored"] for sample in got] == [0] * G


def scale_metric(url: str, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"trl_longrm_reward_server_{name}{want} "))  # fmt: skip


def test_verl_streams_a_4096_sample_step_and_every_group_is_judged_whole(runs, scale_server):
    """verl's own `RewardLoopWorker`s, its default 8 of them, each taking at most 1,000 calls at once (Ray's async
    actor default), every sample of a 512 x 8 step sent at once to a worker picked at random: every sample gets its
    whole group's ranking reward, no group judged after a timeout; and OpenRLHF's own executor on the same step, its
    prompts cut from the front by OpenRLHF, gets the same rewards."""
    expected = [r for group in scale_samples()["responses"] for r in judge_steering.expected_ranking(group)]
    verl = runs["results"]["verl_scale"]
    assert verl["workers"] == 8 and verl["unscored"] == 0
    assert verl["rewards"] == pytest.approx(expected)
    openrlhf = runs["results"]["openrlhf_scale"]
    assert openrlhf["prompts_cut"] == SCALE_PROMPTS  # every prompt was over OpenRLHF's max_len
    assert openrlhf["rewards"] == pytest.approx(expected)
    url, _ = scale_server
    assert scale_metric(url, "groups_total", outcome="whole") == 2 * SCALE_PROMPTS
    assert scale_metric(url, "groups_total", outcome="partial") == scale_metric(url, "group_timeouts_total") == 0
    assert scale_metric(url, "requests_total", route="/verl", status="200") == SCALE_PROMPTS * SCALE_G
    assert scale_metric(url, "requests_total", route="/get_reward", status="200") == SCALE_PROMPTS * SCALE_G


def test_a_step_verls_reward_workers_cannot_hold_is_refused_naming_the_setting(runs):
    error = runs["results"]["verl_slots"]["error"]
    assert error is not None and "16384 samples" in error and "Set reward.num_workers=15" in error


def test_per_sample_routes_judge_pointwise(runs):
    """verl's `naive` manager calling our `compute_score` per sample, and OpenRLHF's executor calling our `.py`
    `reward_func` per sample: the pointwise score the steered judge writes (quality % 10)."""
    expected = [judge_steering.quality(text) % 10 for group in RESPONSES for text in group]
    verl = runs["results"]["verl_function"]
    assert verl["streamed"] == pytest.approx(expected) and verl["batched"] == pytest.approx(expected)
    got = [sample["reward"] for group in runs["results"]["openrlhf_file"]["rewards"] for sample in group]
    assert got == pytest.approx(expected)


def test_openrlhf_shows_our_error_despite_its_catch_all(runs):
    """A pairwise judge through the per-sample `.py` route: OpenRLHF catches the error and logs it at INFO; ours is
    logged at ERROR on stderr first, naming the fix."""
    rewards = runs["results"]["openrlhf_file_pairwise"]["rewards"]
    assert all(sample["reward"] is None for group in rewards for sample in group)
    assert "ERROR trl_longrm.rewards.openrlhf" in runs["stderr"]
    assert "trl-longrm reward-server --group-size N" in runs["stderr"]
