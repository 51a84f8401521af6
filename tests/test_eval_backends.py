"""`trl-longrm eval --backend transformers|vllm|openai`: the demo's trained judge and DisRM (heads of 64 dimensions, which
vLLM's CPU attention runs) on the demo benchmark through an in-process `vllm.LLM` and through real vLLM servers give
the transformers backend's verdicts and scores; a resumed run never mixes two engines; the API key is written nowhere;
every mistake (a server down, a model it does not serve, a DisRM on a server without the pooling runner, vLLM missing,
the wrong head, a setting of another backend) is one error line.

Engine starts are the cost (~60-80 s each on a 2-core machine): one in-process engine per model (a script in vLLM's
venv), one server per model, each started once for the module and stopped before the next starts.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_one_error, run_cli
from vllm_support import require_vllm, run_in_vllm_venv, vllm_server

from trl_longrm.cli import main
from trl_longrm.demo import JUDGE_PROMPTS, SMALL_DEMO, DemoConfig, run_demo
from trl_longrm.evaluation import EvalConfig, evaluate_reward_model
from trl_longrm.evaluation.cli import add_eval_arguments, config_flags, config_from_args
from trl_longrm.serving.server import free_port


# vLLM engines and servers, and the demo's two-process DisRM: run one test at a time (`make test`'s second phase).
pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[1]
# The reduced demo of tests/test_demo.py without stage II (stage I's judge writes a score in every judgment), with heads
# of 64 dimensions: ~2 min on 2 cores. `TRL_LONGRM_DEMO64_DIR` keeps it between runs (the demo resumes its folder).
DEMO = dict(SMALL_DEMO, head_dim=64, stages=["simpo_disrm", "sft"])
# Every backend judges with the same settings; 4096 tokens is the test servers' context (`vllm_support.CPU_ARGS`) and
# longer than every demo record, so that nothing is cut.
COMMON = dict(max_length=4096, batch_size=16, seed=0)
GRM = dict(COMMON, formats=["PairWise"], judge_protocol="pointwise", prompt_template=str(JUDGE_PROMPTS), max_new_tokens=16)
DISRM = dict(COMMON, is_disrm=True)
# A key the test server requires; it must appear in no file and no output.
SENTINEL = "sk-sentinel-3f9c2a7b41d0"


def predictions(save_path) -> dict[str, dict]:
    lines = (Path(save_path) / "predictions.jsonl").read_text().splitlines()
    return {p["id"]: p for p in map(json.loads, lines)}


def results_of(save_path) -> dict:
    return json.loads(next(Path(save_path).glob("results*.json")).read_text())


def as_flags(settings: dict) -> list[str]:
    """`trl-longrm eval` flags of `EvalConfig` settings."""
    flags = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return flags


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    require_vllm()  # before the training: without vLLM's venv nothing here can run
    root = Path(os.environ.get("TRL_LONGRM_DEMO64_DIR") or tmp_path_factory.mktemp("demo64") / "demo")
    run_demo(DemoConfig(output_dir=str(root), **DEMO))
    return {
        "grm": str(root / "runs" / "sft"),
        "disrm": str(root / "runs" / "simpo_disrm"),
        "bench": str(root / "data" / "bench"),
        "out": tmp_path_factory.mktemp("eval_backends"),
    }


@pytest.fixture(scope="module")
def reference(demo):
    """The transformers backend's runs (float32 on CPU), the reference of every other backend."""
    runs = {}
    for kind, settings in (("grm", GRM), ("disrm", DISRM)):
        save_path = demo["out"] / f"transformers_{kind}"
        config = EvalConfig(model_path=demo[kind], data_path=demo["bench"], save_path=str(save_path), device="cpu",
                            dtype="float32", **settings)  # fmt: skip
        runs[kind] = {"results": evaluate_reward_model(config), "predictions": predictions(save_path), "path": save_path}
    return runs


@pytest.fixture(scope="module")
def vllm_runs(demo):
    """Both models evaluated by `evaluate_reward_model(backend="vllm")` in vLLM's venv, one engine at a time."""
    paths = {}
    for kind, settings in (("grm", GRM), ("disrm", DISRM)):
        paths[kind] = demo["out"] / f"vllm_{kind}"
        config = dict(settings, model_path=demo[kind], data_path=demo["bench"], save_path=str(paths[kind]),
                      dtype="float32", gpu_memory_utilization=0.08)  # fmt: skip
        # vLLM's venv runs this checkout's package (installed there without dependencies, pointing elsewhere).
        env = {"PYTHONPATH": str(ROOT)}
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            run_in_vllm_venv(ROOT / "tests" / "vllm_eval_worker.py", json.dumps(config))
    return paths


def assert_grm_matches(reference: dict, save_path):
    """Greedy judgments identical on >= 97% of the records, PairWise accuracy within 1 point, AUC within 0.01."""
    got, want = predictions(save_path), reference["predictions"]
    assert got.keys() == want.keys()
    same = sum(got[key]["judgments"] == want[key]["judgments"] for key in want)
    assert same >= 0.97 * len(want), f"{same} of {len(want)} records judged alike"
    results = results_of(save_path)
    assert abs(results["pairwise_avg"] - reference["results"]["pairwise_avg"]) <= 0.01
    assert abs(results["auc"] - reference["results"]["auc"]) <= 0.01
    assert results["counts"]["records"] == reference["results"]["counts"]["records"] == len(want)
    assert results["bounded_verdict_probs"] == 0  # vLLM reports every verdict token's log-probability


def assert_disrm_matches(reference: dict, save_path):
    """Every candidate's score within 1e-4 of transformers' (vLLM's last-token pooling, raw logit)."""
    got, want = predictions(save_path), reference["predictions"]
    assert got.keys() == want.keys()
    worst = max(abs(a - b) for key in want for a, b in zip(got[key]["scores"], want[key]["scores"], strict=True))
    assert worst < 1e-4, worst
    assert abs(results_of(save_path)["pairwise_avg"] - reference["results"]["pairwise_avg"]) <= 0.01


def test_vllm_in_process_matches_transformers(reference, vllm_runs):
    assert_grm_matches(reference["grm"], vllm_runs["grm"])
    assert_disrm_matches(reference["disrm"], vllm_runs["disrm"])
    identity = json.loads((vllm_runs["grm"] / "run_config.json").read_text())
    assert identity["backend"] == "vllm" and identity["vllm"] and identity["tensor_parallel_size"] == 1


def files_holding(root: Path, text: str) -> list[str]:
    return [str(path) for path in root.rglob("*") if path.is_file() and text.encode() in path.read_bytes()]


class TestJudgeServer:
    """One vLLM server of the judge, requiring the API key `SENTINEL`, for the tests of this class."""

    @pytest.fixture(scope="class")
    def server(self, demo):
        with vllm_server(demo["grm"], "--api-key", SENTINEL, served_model_name="judge") as server:
            yield server

    def eval_flags(self, demo, server, save_path, *extra) -> list[str]:
        return ["--model-path", demo["grm"], "--data-path", demo["bench"], "--save-path", str(save_path),
                *as_flags(GRM), "--backend", "openai", "--base-url", server.base_url, *extra]  # fmt: skip

    def test_openai_matches_transformers_and_never_writes_the_api_key(self, demo, reference, server, tmp_path):
        # Two processes (each its own client): the key reaches them through the environment, not the command line
        # (the server refuses requests without it, so a process without the key fails).
        save_path = tmp_path / "openai_grm"
        run = subprocess.run([sys.executable, "-m", "trl_longrm", "eval", *self.eval_flags(demo, server, save_path),
                              "--api-key", SENTINEL, "--num-processes", "2"], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert_grm_matches(reference["grm"], save_path)
        assert "Launching:" in run.stdout and SENTINEL not in run.stdout + run.stderr
        assert files_holding(save_path, SENTINEL) == []
        assert results_of(save_path)["config"]["api_key"] is None  # the processes had it from the environment
        identity = json.loads((save_path / "run_config.json").read_text())
        assert identity["backend"] == "openai" and identity["served_model"] == "judge"
        assert identity["served_checkpoint"] == demo["grm"] and identity["server_version"]

    def test_a_resumed_run_never_mixes_two_engines(self, demo, reference, vllm_runs, server, tmp_path, capsys,
                                                   monkeypatch):  # fmt: skip
        monkeypatch.setenv("OPENAI_API_KEY", SENTINEL)
        # The transformers run's folder refuses the server's verdicts, and the in-process vLLM run's too.
        for path, old in ((reference["grm"]["path"], "None"), (vllm_runs["grm"], "'vllm'")):
            before = (path / "predictions.jsonl").read_bytes()
            code, stderr = run_cli(capsys, "eval", *self.eval_flags(demo, server, path))
            assert_one_error(code, stderr, "holds predictions of a different run (", f"backend: {old} -> 'openai'")
            assert (path / "predictions.jsonl").read_bytes() == before
        # A run of the server resumes on the same server (nothing left to judge), not on transformers.
        # The key given as a flag is redacted in the results and written nowhere.
        save_path = tmp_path / "openai"
        code = main(["eval", *self.eval_flags(demo, server, save_path, "--tasks", "LongQA"), "--api-key", SENTINEL])
        output = capsys.readouterr()
        assert code == 0 and "Predictions and results written" in output.out
        assert SENTINEL not in output.out + output.err
        assert results_of(save_path)["config"]["api_key"] == "<redacted>" and files_holding(save_path, SENTINEL) == []
        before = (save_path / "predictions.jsonl").read_bytes()
        assert run_cli(capsys, "eval", *self.eval_flags(demo, server, save_path, "--tasks", "LongQA"))[0] == 0
        assert (save_path / "predictions.jsonl").read_bytes() == before
        flags = ["--model-path", demo["grm"], "--data-path", demo["bench"], "--save-path", str(save_path), "--tasks",
                 "LongQA", *as_flags(GRM)]  # fmt: skip
        code, stderr = run_cli(capsys, "eval", *flags)
        assert_one_error(code, stderr, "backend: 'openai' -> None", "served_model: 'judge' -> None")

    def test_server_mistakes_are_one_error_line(self, demo, server, tmp_path, capsys, monkeypatch):
        flags = self.eval_flags(demo, server, tmp_path / "out")
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        code, stderr = run_cli(capsys, "eval", *flags, "--max-retries", "0")
        assert_one_error(code, stderr, f"{server.base_url}/models answered 401")
        monkeypatch.setenv("OPENAI_API_KEY", SENTINEL)
        code, stderr = run_cli(capsys, "eval", *flags, "--served-model", "other")
        assert_one_error(code, stderr, "does not serve 'other'; it serves ['judge']", "--served-model")
        # The DisRM given to a server of the judge (no pooling runner, no `/classify`).
        code, stderr = run_cli(capsys, "eval", flags[0], demo["disrm"], *flags[2:], "--is-disrm")
        assert_one_error(code, stderr, "cannot score sequences", "--runner pooling")
        assert SENTINEL not in stderr

    def test_bounded_verdict_probs_are_counted(self, demo, server, tmp_path):
        """A server that reports only its top-k log-probabilities (vLLM asked as another server would be: no
        `logprob_token_ids`, top 1): the verdict tokens it leaves out are bounds, counted per record and in the
        results."""
        from trl_longrm.evaluation import GenerativeJudge
        from trl_longrm.evaluation.judges import load_tokenizer
        from trl_longrm.evaluation.templates import PromptTemplate
        from trl_longrm.serving import OpenAIGenerator

        tokenizer = load_tokenizer(demo["grm"])
        engine = OpenAIGenerator(server.base_url, "judge", tokenizer=tokenizer, top_logprobs=1, api_key=SENTINEL)
        engine.vllm_fields = False
        judge = GenerativeJudge(engine, tokenizer, max_length=4096, max_new_tokens=16, protocol="pointwise",
                                template=PromptTemplate.from_yaml(str(JUDGE_PROMPTS)))  # fmt: skip
        config = EvalConfig(model_path=demo["grm"], data_path=demo["bench"], save_path=str(tmp_path / "topk"),
                            **dict(GRM, tasks=["LongQA"]))  # fmt: skip
        results = evaluate_reward_model(config, judge=judge)
        per_record = [p.get("bounded_verdict_probs", 0) for p in predictions(tmp_path / "topk").values()]
        # Each record has 2 judgments, one score each out of 10 score tokens: with the top 1 only, at most one of the
        # 10 is reported at a step, so every score is a bound.
        assert per_record == [2] * len(per_record)
        assert results["bounded_verdict_probs"] == sum(per_record) == judge.bounded_verdict_probs > 0
        assert "Verdict probabilities bounded" in next((tmp_path / "topk").glob("results*.md")).read_text()


def test_disrm_server_matches_transformers(demo, reference, tmp_path, capsys):
    with vllm_server(demo["disrm"], "--runner", "pooling", served_model_name="disrm") as server:
        code, stderr = run_cli(capsys, "eval", "--model-path", demo["disrm"], "--data-path", demo["bench"],
                               "--save-path", str(tmp_path / "openai_disrm"), *as_flags(DISRM), "--backend", "openai",
                               "--base-url", server.base_url)  # fmt: skip
    assert code == 0, stderr
    assert_disrm_matches(reference["disrm"], tmp_path / "openai_disrm")


# ------------------------------------------------------------------------------ mistakes found before any engine starts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trl_longrm.evaluation import make_toy_benchmark
    from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("eval_backends_tiny")
    tokenizer = build_chat_tokenizer()
    return {
        "bench": str(make_toy_benchmark(root / "bench", tasks=["LongQA"], pairwise_per_task=1, bestofn_per_task=0)),
        "grm": save_tiny_model(root / "grm", tokenizer=tokenizer, seed=8),
    }


def test_mistakes_before_any_engine_are_one_error_line(tiny, tmp_path, capsys, monkeypatch):
    common = ["--model-path", tiny["grm"], "--data-path", tiny["bench"], "--tasks", "LongQA", "--save-path",
              str(tmp_path / "out")]  # fmt: skip
    # Nothing listens at the address.
    url = f"http://127.0.0.1:{free_port()}/v1"
    code, stderr = run_cli(capsys, "eval", *common, "--backend", "openai", "--base-url", url, "--max-retries", "0")
    assert_one_error(code, stderr, f"Cannot reach the server at {url}", "Is it running?")
    # A judge checkpoint evaluated as a DisRM on vLLM: refused before vLLM is imported.
    code, stderr = run_cli(capsys, "eval", *common, "--backend", "vllm", "--is-disrm")
    assert_one_error(code, stderr, f"{tiny['grm']} is a LlamaForCausalLM checkpoint", "without --is-disrm")
    # vLLM not installed (here made unimportable, whatever this environment holds).
    monkeypatch.setitem(sys.modules, "vllm", None)
    code, stderr = run_cli(capsys, "eval", *common, "--backend", "vllm")
    assert_one_error(code, stderr, "The vllm backend needs vLLM in this environment", "--backend openai")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--base-url", "http://x/v1", "--tensor-parallel-size", "2"], "--backend transformers does not use "
         "--tensor-parallel-size, --base-url: leave them out"),
        (["--backend", "vllm", "--max-concurrency", "4"], "--backend vllm does not use --max-concurrency"),
        (["--backend", "vllm", "--device", "cpu"], "--backend vllm does not use --device"),
        (["--backend", "openai", "--base-url", "http://x/v1", "--no-enable-prefix-caching", "--dtype", "float32"],
         "--backend openai does not use --enable-prefix-caching, --dtype"),
        (["--backend", "openai"], "--backend openai needs --base-url"),
        (["--backend", "vllm", "--gpu-memory-utilization", "1.5"], "`gpu_memory_utilization` must be in (0, 1]"),
    ],
)  # fmt: skip
def test_settings_of_another_backend_are_refused(tiny, tmp_path, capsys, argv, expected):
    code, stderr = run_cli(capsys, "eval", "--model-path", tiny["grm"], "--data-path", tiny["bench"], "--save-path",
                           str(tmp_path / "out"), *argv)  # fmt: skip
    assert_one_error(code, stderr, expected)


def test_the_api_key_stays_off_the_command_line():
    config = EvalConfig(model_path="m", data_path="d", backend="openai", base_url="http://x/v1", api_key=SENTINEL,
                        max_concurrency=4, enable_prefix_caching=None)  # fmt: skip
    flags = config_flags(config)
    assert SENTINEL not in " ".join(flags) and "--api-key" not in flags and "--max-concurrency" in flags
    # The processes get every other setting back from the flags (and the key from the environment).
    parsed = config_from_args(add_eval_arguments(argparse.ArgumentParser()).parse_args(flags))
    assert parsed == dataclasses.replace(config, api_key=None)
    vllm = EvalConfig(model_path="m", data_path="d", backend="vllm", gpu_memory_utilization=0.5,
                      enable_prefix_caching=False, tensor_parallel_size=2)  # fmt: skip
    assert config_from_args(add_eval_arguments(argparse.ArgumentParser()).parse_args(config_flags(vllm))) == vllm
    assert config.redacted()["api_key"] == "<redacted>" and config.api_key == SENTINEL


def test_demo_head_dim_leaves_the_published_demo_unchanged(tmp_path):
    from trl_longrm.demo import DEMO_MODEL, Demo

    # Default: the published demo's 8 heads of 16 and its settings file as before (its folders still resume).
    default = Demo(DemoConfig(output_dir=str(tmp_path / "a")))
    assert default.model_shape() == DEMO_MODEL and default.settings()["model"] == DEMO_MODEL
    shape = Demo(DemoConfig(output_dir=str(tmp_path / "b"), head_dim=64)).model_shape()
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]) == (2, 2, 64)
    with pytest.raises(ValueError, match="must divide `hidden_size` \\(128\\)"):
        DemoConfig(head_dim=48)
