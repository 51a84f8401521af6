"""`trl-longrm eval --num-processes 2`: two CPU processes (accelerate launch, gloo) give one process's results."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_longrm.evaluation import EvalConfig, evaluate_reward_model, make_toy_benchmark
from trl_longrm.evaluation.cli import add_eval_arguments, config_flags, config_from_args
from trl_longrm.testing_utils import save_tiny_model


def _predictions(path):
    lines = (Path(path) / "predictions.jsonl").read_text().splitlines()
    return {p["id"]: p for p in map(json.loads, lines)}


def test_config_flags_round_trip():
    config = EvalConfig(
        model_path="m",
        data_path="d",
        is_disrm=True,
        verdict_probs=False,
        tasks=["LongQA", "Math"],
        formats=["PairWise"],
        protocol="longrm",
        max_length=4096,
        prompt_template="t.yaml",
    )
    parsed = add_eval_arguments(argparse.ArgumentParser()).parse_args(config_flags(config))
    assert config_from_args(parsed) == config


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["disrm", "grm"])
def test_two_processes_equal_one(tmp_path, kind):
    bench = str(make_toy_benchmark(tmp_path / "bench", tasks=["LongQA", "Code"], pairwise_per_task=3, bestofn_per_task=2))
    if kind == "disrm":
        model = save_tiny_model(tmp_path / "model", "llama", "seq-cls")
        extra = ["--is-disrm", "--batch-size", "2"]
    else:
        model = save_tiny_model(tmp_path / "model", "qwen3", "causal-lm")
        extra = ["--max-new-tokens", "3", "--max-length", "400"]
    flags = ["--model-path", model, "--data-path", bench, "--tasks", "LongQA", "Code", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    two = subprocess.run(
        [sys.executable, "-m", "trl_longrm", "eval", *flags, "--save-path", str(tmp_path / "two"), "--num-processes", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # The whole output: a rank's own error comes before the traceback of the rank that waited for it.
    assert two.returncode == 0, two.stdout + two.stderr
    # The records were dealt out to both processes; the table is printed once, and the shards were merged away.
    logs = two.stdout + two.stderr
    assert "Process 0 of 2 judges 5 records" in logs and "Process 1 of 2 judges 5 records" in logs
    assert two.stdout.count("| Model |") == 1
    assert not list((tmp_path / "two").glob("predictions.rank*.jsonl"))

    args = add_eval_arguments(argparse.ArgumentParser()).parse_args([*flags, "--save-path", str(tmp_path / "one")])
    one_results = evaluate_reward_model(config_from_args(args))
    two_results = json.loads((tmp_path / "two" / "results.json").read_text())
    one, both = _predictions(tmp_path / "one"), _predictions(tmp_path / "two")
    assert sorted(one) == sorted(both) and len(one) == 10
    for rid, p in one.items():
        q = both[rid]
        for key in ("order", "output", "predicted_ranks", "judgments", "truncated", "match_ratio"):
            assert p[key] == q[key], (rid, key)
        for key in ("scores", "verdict_probs"):
            assert (p[key] is None) == (q[key] is None)
            if p[key] is not None:
                assert p[key] == pytest.approx(q[key], abs=1e-5)
    for key in ("tasks", "same", "diff", "pairwise_avg", "rank", "rank_avg", "length", "average", "counts"):
        assert one_results[key] == two_results[key], key
    assert one_results["auc"] == pytest.approx(two_results["auc"])
