"""`--protocol longrm` on a judge whose model length is the cut length (512 positions, `--max-length 512`), as LongRM's
8B judges are evaluated at 131,072: vLLM starts (asking for max_length + max_new_tokens was above the model's own length
and refused), a record at the limit is cut to 507 tokens and its judgment gets the 5 tokens the model's length leaves
(LongRM's vLLM call sets no `max_model_len`: vLLM stops there), and the transformers and vLLM backends write the same
judgments."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_support import ROOT, VLLM_SHAPE, run_in_vllm_venv

from trl_longrm.evaluation import EvalConfig, evaluate_reward_model
from trl_longrm.evaluation.judges import GenerativeJudge, JudgeRequest
from trl_longrm.serving.transformers_engine import TransformersGenerator
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


LENGTH, NEW = 512, 64
WORDS = "the city river number name year color animal planet capital author book price height".split()


def record(rid, words):
    return {"id": rid, "prompt_template": [{"role": "user", "content": " ".join(WORDS[i % len(WORDS)] for i in range(words))}],
            "chosen": f"answer one {rid}", "rejected": f"answer two {rid}", "tasktype": "PairWise", "subtype": "same",
            "ctx_length_for_length": "8k", "source": "fixture"}  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("longrm_budget")
    judge = save_tiny_model(root / "judge", arch="qwen3", tokenizer=build_chat_tokenizer(), seed=3,
                            max_position_embeddings=LENGTH, **VLLM_SHAPE)  # fmt: skip
    bench = root / "bench"
    bench.mkdir()
    rows = [record("long", 900), record("short1", 20), record("short2", 40)]
    (bench / "LongQA.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"judge": judge, "bench": str(bench), "root": root}


def test_a_cut_prompt_gets_what_the_model_length_leaves(setup):
    tokenizer = AutoTokenizer.from_pretrained(setup["judge"])
    engine = TransformersGenerator(AutoModelForCausalLM.from_pretrained(setup["judge"], dtype="float32"), tokenizer)
    calls, generate = [], engine.generate

    def recorded(prompts, max_new_tokens, logprob_token_ids=None):
        generations = generate(prompts, max_new_tokens, logprob_token_ids)
        calls.append(([len(p) for p in prompts], max_new_tokens, [len(g.token_ids) for g in generations]))
        return generations

    engine.generate = recorded
    judge = GenerativeJudge(engine, tokenizer, max_length=LENGTH, max_new_tokens=NEW, verdict_probs=False,
                            evaluation_protocol="longrm")  # fmt: skip
    long_task = " ".join(WORDS[i % len(WORDS)] for i in range(900))
    [out] = judge.judge([JudgeRequest("x", [], long_task, ["a", "b"], ranking=False)])
    # The prompt cut to 507 tokens, the judgment given the 5 the model's 512 positions leave (not max_new_tokens).
    assert out.truncated and calls == [([LENGTH - 5], 5, [5])]


@pytest.mark.slow
def test_vllm_starts_and_matches_transformers(setup):
    common = dict(model_path=setup["judge"], data_path=setup["bench"], protocol="longrm", max_length=LENGTH,
                  max_new_tokens=NEW, formats=["PairWise"], tasks=["LongQA"], dtype="float32",
                  verdict_probs=False)  # fmt: skip
    reference = setup["root"] / "transformers"
    evaluate_reward_model(EvalConfig(save_path=str(reference), device="cpu", **common))
    served = setup["root"] / "vllm"
    config = dict(common, save_path=str(served), gpu_memory_utilization=0.08)
    run_in_vllm_venv(ROOT / "tests" / "vllm_eval_worker.py", json.dumps(config))

    def predictions(path):
        return {p["id"]: p for p in map(json.loads, (path / "predictions.jsonl").read_text().splitlines())}

    want, got = predictions(reference), predictions(served)
    assert want.keys() == got.keys() and len(want) == 3
    assert [got[k]["output"] for k in want] == [want[k]["output"] for k in want]
    assert got["LongQA/long"]["truncated"] and not got["LongQA/short1"]["truncated"]
