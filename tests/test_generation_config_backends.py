"""The checkpoint's generation config applied alike on every backend: a judge whose `generation_config.json` sets a
repetition penalty writes the same greedy judgments, with the same verdict log-probabilities (expected scores), on
transformers (`generate` reads it), vLLM in process (given it explicitly: `LLM.generate` ignores it under explicit
sampling parameters) and a vLLM server (sent with each request); without the penalty the judgments differ (so the
comparison could fail). A field vLLM cannot apply is refused on its backends, naming it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from vllm_support import ROOT, VLLM_SHAPE, run_in_vllm_venv, vllm_server

from trl_longrm.evaluation.judges import GenerativeJudge, JudgeRequest
from trl_longrm.serving import OpenAIGenerator
from trl_longrm.serving.base import greedy_settings
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


pytestmark = pytest.mark.slow
PAIRS = [(f"Task {i}: " + " ".join(["river city colour"] * (3 + i)), f"Answer {i}: the city by the river.")
         for i in range(3)]  # fmt: skip
PENALTY = 1.8


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("penalised") / "judge", arch="qwen3",
                           tokenizer=build_chat_tokenizer(), seed=3, **VLLM_SHAPE)  # fmt: skip
    config = GenerationConfig.from_pretrained(path)
    config.repetition_penalty = PENALTY
    config.save_pretrained(path)
    return str(path)


def judge_with(engine_or_model, tokenizer):
    return GenerativeJudge(engine_or_model, tokenizer, max_length=4096, max_new_tokens=24, protocol="pointwise")


def run(judge):
    outputs = judge.judge([JudgeRequest(str(i), [], task, [response], False) for i, (task, response) in enumerate(PAIRS)])
    return [o.judgments[0] for o in outputs], [o.scores[0] for o in outputs]


def test_backends_apply_the_repetition_penalty_alike(judge_path):
    tokenizer = AutoTokenizer.from_pretrained(judge_path)
    model = AutoModelForCausalLM.from_pretrained(judge_path, dtype="float32")
    assert model.generation_config.repetition_penalty == PENALTY
    texts, scores = run(judge_with(model, tokenizer))

    model.generation_config.repetition_penalty = 1.0
    unpenalised, _ = run(judge_with(model, tokenizer))
    assert unpenalised != texts  # the penalty changes the greedy judgments of this judge

    assert greedy_settings(judge_path, "openai") == {"repetition_penalty": PENALTY}
    with vllm_server(judge_path, served_model_name="judge") as server:
        engine = OpenAIGenerator(server.base_url, "judge", tokenizer=tokenizer, **greedy_settings(judge_path, "openai"))
        served_texts, served_scores = run(judge_with(engine, tokenizer))
    assert served_texts == texts
    assert served_scores == pytest.approx(scores, abs=1e-3)

    result = run_in_vllm_venv(ROOT / "tests" / "generation_config_worker.py", judge_path, json.dumps(PAIRS))
    in_process = json.loads(next(line[7:] for line in result.stdout.splitlines() if line.startswith("RESULT ")))
    assert in_process["greedy"] == {"repetition_penalty": PENALTY}
    assert in_process["judgments"] == texts
    assert in_process["scores"] == pytest.approx(scores, abs=1e-3)


def test_a_field_vllm_cannot_apply_is_refused(tmp_path):
    path = save_tiny_model(tmp_path / "judge", tokenizer=build_chat_tokenizer(), seed=3)
    config = GenerationConfig.from_pretrained(path)
    config.no_repeat_ngram_size = 3
    config.save_pretrained(path)
    assert greedy_settings(str(path), "transformers") == {}  # transformers applies it itself
    with pytest.raises(ValueError, match=r"no_repeat_ngram_size=3.*the vllm backend cannot apply"):
        greedy_settings(str(path), "vllm")
