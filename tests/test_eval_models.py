"""End to end with tiny saved models: a generative judge (causal LM) and a discriminative one (1-label classifier)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_longrm.cli import main
from trl_longrm.data import tokenize_preference_record
from trl_longrm.evaluation import (
    TASKS,
    DiscriminativeJudge,
    EvalConfig,
    GenerativeJudge,
    JudgeRequest,
    evaluate_reward_model,
    load_benchmark,
    make_toy_benchmark,
)
from trl_longrm.evaluation.prompts import build_judge_messages, build_pointwise_messages
from trl_longrm.testing_utils import save_tiny_model


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_models")
    return {
        "bench": str(
            make_toy_benchmark(root / "bench", pairwise_per_task=1, bestofn_per_task=1, lengths=("4k", "16k"))
        ),
        "grm": save_tiny_model(root / "grm", "qwen3", "causal-lm"),
        "disrm": save_tiny_model(root / "disrm", "llama", "seq-cls"),
        "root": root,
    }


def _requests(paths, n):
    records = load_benchmark(paths["bench"], list(TASKS), ["PairWise"])[:n]
    return [JudgeRequest(r.id, r.prompt_messages, r.task_prompt, r.candidates, ranking=False) for r in records]


def _compare_predictions(a, b):
    a, b = sorted(a, key=lambda p: p["id"]), sorted(b, key=lambda p: p["id"])
    assert [p["id"] for p in a] == [p["id"] for p in b]
    for x, y in zip(a, b):
        for key in ("order", "output", "predicted_ranks", "truncated", "match_ratio"):
            assert x[key] == y[key], (x["id"], key)
        for key in ("scores", "verdict_probs"):
            assert (x[key] is None) == (y[key] is None)
            if x[key] is not None:
                assert x[key] == pytest.approx(y[key], abs=1e-5)


def _lines(path):
    return [json.loads(line) for line in (path / "predictions.jsonl").read_text().splitlines()]


def test_generative_judge_end_to_end_batch_invariant(paths):
    root = paths["root"]
    kwargs = dict(model_path=paths["grm"], data_path=paths["bench"], max_new_tokens=3, max_length=512)
    one = evaluate_reward_model(EvalConfig(save_path=str(root / "grm1"), batch_size=1, **kwargs))
    four = evaluate_reward_model(EvalConfig(save_path=str(root / "grm4"), batch_size=4, **kwargs))
    assert one["model_type"] == "GRM" and one["counts"]["records"] == 14
    # A random tiny LM writes no verdict: every record is counted unparseable and wrong.
    assert one["unparseable"] == {"total": 14, "PairWise": 7, "BestOfN": 7}
    assert one["average"] == 0.0
    # No verdict parsed, so no AUC (the forced-decoding verdict probabilities of the 7 PairWise records are kept, and
    # equal at both batch sizes: `_compare_predictions`).
    assert (one["auc"], one["auc_source"], one["auc_pairs"]) == (four["auc"], None, 0) == (None, None, 0)
    assert all(len(p["verdict_probs"]) == 2 for p in _lines(root / "grm1") if p["tasktype"] == "PairWise")
    _compare_predictions(_lines(root / "grm1"), _lines(root / "grm4"))
    # Truncation count, checked against the judge prompts' own lengths.
    tokenizer = AutoTokenizer.from_pretrained(paths["grm"])
    over = 0
    for record in load_benchmark(paths["bench"], list(TASKS), ["PairWise", "BestOfN"]):
        messages = build_judge_messages(record.task_prompt, record.candidates, ranking=record.tasktype == "BestOfN")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The prompt leaves room for the judgment: prompt + max_new_tokens fit in max_length.
        over += len(tokenizer(text, add_special_tokens=False)["input_ids"]) > 512 - 3
    assert 0 < one["truncated"] == over < 14


def test_verdict_probs_match_a_single_unpadded_forward(paths):
    tokenizer = AutoTokenizer.from_pretrained(paths["grm"])
    model = AutoModelForCausalLM.from_pretrained(paths["grm"])
    judge = GenerativeJudge(model, tokenizer, max_new_tokens=3)
    requests = _requests(paths, 3)  # different lengths: the batch is left-padded
    outputs = judge.judge(requests)
    for request, output in zip(requests, outputs):
        messages = build_judge_messages(request.task_prompt, request.responses)
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        reasoning = output.text.split("[[")[0]
        ids = (
            tokenizer(prompt, add_special_tokens=False)["input_ids"]
            + tokenizer(reasoning, add_special_tokens=False)["input_ids"]
            + tokenizer("[[", add_special_tokens=False)["input_ids"]
        )
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        a, b = probs[tokenizer.convert_tokens_to_ids("A")], probs[tokenizer.convert_tokens_to_ids("B")]
        assert output.verdict_probs == pytest.approx([float(a / (a + b)), float(b / (a + b))], abs=1e-5)


def test_pointwise_scores_are_expected_scores_of_a_single_unpadded_forward(paths):
    tokenizer = AutoTokenizer.from_pretrained(paths["grm"])
    model = AutoModelForCausalLM.from_pretrained(paths["grm"])
    judge = GenerativeJudge(model, tokenizer, max_new_tokens=3, protocol="pointwise")
    requests = _requests(paths, 3)
    outputs = judge.judge(requests)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    for request, output in zip(requests, outputs):
        assert output.text is None and len(output.judgments) == len(output.scores) == 2
        for response, judgment, score in zip(request.responses, output.judgments, output.scores):
            messages = build_pointwise_messages(request.task_prompt, response)
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # Greedy generation of this judgment alone gives the same text as the left-padded batch.
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            alone = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, len(ids) :]
            assert tokenizer.decode(alone, skip_special_tokens=True) == judgment
            forced = ids + tokenizer(judgment.split("[[")[0], add_special_tokens=False)["input_ids"]
            forced += tokenizer("[[", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                probs = model(torch.tensor([forced])).logits[0, -1].softmax(-1)[digits]
            assert score == pytest.approx(float((probs / probs.sum()) @ torch.arange(10.0)), abs=1e-4)


def test_judgments_are_generated_with_the_kv_cache_even_if_the_saved_model_turns_it_off(paths):
    """transformers' Trainer saves the models it trains with `use_cache: false`: the judge still generates with the
    cache (one pass over the prompt, then one token per pass), and writes what generation without it writes."""
    tokenizer = AutoTokenizer.from_pretrained(paths["grm"])
    model = AutoModelForCausalLM.from_pretrained(paths["grm"])
    model.config.use_cache = model.generation_config.use_cache = False
    judge = GenerativeJudge(model, tokenizer, max_new_tokens=4, protocol="pointwise", verdict_probs=False)
    lengths = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)  # fmt: skip
    try:
        outputs = judge.judge(_requests(paths, 2))
    finally:
        hook.remove()
    assert lengths[0] > 1 and lengths[1:] == [1] * (len(lengths) - 1), lengths
    # The reference: each judgment alone, generated without the cache.
    judgments = [j for output in outputs for j in output.judgments]
    prompts = [judge._prompt_ids(judge.template.pointwise_messages(r.task_prompt, response))[0]
               for r in _requests(paths, 2) for response in r.responses]  # fmt: skip
    for ids, judgment in zip(prompts, judgments):
        alone = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, use_cache=False)
        assert tokenizer.decode(alone[0, len(ids) :], skip_special_tokens=True) == judgment


def test_pointwise_judge_end_to_end(paths):
    root = paths["root"]
    kwargs = dict(model_path=paths["grm"], data_path=paths["bench"], max_new_tokens=3, judge_protocol="pointwise")
    one = evaluate_reward_model(EvalConfig(save_path=str(root / "point1"), batch_size=1, **kwargs))
    three = evaluate_reward_model(EvalConfig(save_path=str(root / "point3"), batch_size=3, **kwargs))
    # A random tiny LM writes no score: every record is unparseable, and every candidate got its own judgment.
    assert one["unparseable"]["total"] == one["counts"]["records"] == 14
    lines = _lines(root / "point1")
    assert all(len(p["judgments"]) == len(p["order"]) == len(p["scores"]) for p in lines)
    assert (one["auc"], one["auc_source"], one["auc_pairs"]) == (three["auc"], None, 0) == (None, None, 0)
    _compare_predictions(lines, _lines(root / "point3"))
    # Resuming the directory under the other protocol is refused.
    with pytest.raises(ValueError, match="judge_protocol"):
        evaluate_reward_model(EvalConfig(save_path=str(root / "point1"), **{**kwargs, "judge_protocol": "pairwise"}))


def test_disrm_scores_match_single_sequence_forward(paths):
    tokenizer = AutoTokenizer.from_pretrained(paths["disrm"])
    model = AutoModelForSequenceClassification.from_pretrained(paths["disrm"])
    requests = _requests(paths, 3)
    outputs = DiscriminativeJudge(model, tokenizer, batch_size=4).judge(requests)
    for request, output in zip(requests, outputs):
        assert len(output.scores) == 2 and output.text is None
        # The reference is the sequence DisRM training scores (the tokenised preference group's prompt + completion,
        # the whole chat rendering: ChatML's newline after the EOS included), scored alone at its last token: what
        # transformers' pooling reads there, and not the EOS before the newline.
        group = tokenize_preference_record(
            {"prompt": request.prompt_messages, "chosen": request.responses[0], "rejected": request.responses[1:]},
            tokenizer,
            whole_rendering=True,
        )
        completions = [group["chosen_completion_ids"], *group["rejected_completion_ids"]]
        for response, completion, score in zip(request.responses, completions, output.scores):
            ids = group["prompt_ids"] + completion
            rendered = tokenizer.apply_chat_template(
                request.prompt_messages + [{"role": "assistant", "content": response}]
            )
            assert rendered["input_ids"] == ids and ids[-2] == tokenizer.eos_token_id
            with torch.no_grad():
                reference = model(torch.tensor([ids])).logits[0, 0].item()
                at_eos = model(torch.tensor([ids[:-1]])).logits[0, 0].item()
            assert score == pytest.approx(reference, abs=1e-5)
            assert abs(score - at_eos) > 1e-4  # the EOS before the newline would give another score


@pytest.mark.parametrize("max_length", [131072, 200])
def test_disrm_shared_prefix_scores_equal_unshared(paths, max_length):
    """A record's 2-4 candidates scored in one row with their common prefix once give the scores of scoring each
    candidate on its own; also when truncation cuts each candidate's sequence differently (max_length=200)."""
    tokenizer = AutoTokenizer.from_pretrained(paths["disrm"])
    model = AutoModelForSequenceClassification.from_pretrained(paths["disrm"])
    records = load_benchmark(paths["bench"], list(TASKS), ["PairWise"])[:5]
    others = [c for r in records for c in r.candidates]
    # 2, 3 and 4 candidates, one of them twice in the last record (a candidate that is all common prefix).
    candidates = [r.candidates + others[-i - 1 : -1] for i, r in enumerate(records[:3])]
    candidates += [records[3].candidates, records[4].candidates + records[4].candidates[:1]]
    requests = [
        JudgeRequest(r.id, r.prompt_messages, r.task_prompt, c, ranking=False) for r, c in zip(records, candidates)
    ]
    assert [len(r.responses) for r in requests] == [2, 3, 4, 2, 3]
    unshared = DiscriminativeJudge(model, tokenizer, max_length=max_length, batch_size=2, shared_prefix=False)
    shared = DiscriminativeJudge(model, tokenizer, max_length=max_length, batch_size=2, shared_prefix=True)
    assert shared.shared_prefix
    want, got = unshared.judge(requests), shared.judge(requests)
    assert model.config._attn_implementation == unshared.model.config._attn_implementation  # switched back
    for a, b in zip(got, want):
        assert a.truncated == b.truncated
        assert a.scores == pytest.approx(b.scores, abs=1e-5)
    assert len({round(s, 4) for out in want for s in out.scores}) > len(requests)  # scores differ between candidates
    if max_length == 200:
        assert any(out.truncated for out in want)


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["shared_prefix", "padded"])
def test_disrm_refuses_an_empty_sequence(paths, shared_prefix):
    """An empty sequence has no last token to score: refused, naming it, instead of being read at its neighbour's last
    token in the packed or padded batch (or failing on a reshape alone)."""
    tokenizer = AutoTokenizer.from_pretrained(paths["disrm"])
    model = AutoModelForSequenceClassification.from_pretrained(paths["disrm"])
    judge = DiscriminativeJudge(model, tokenizer, batch_size=4, shared_prefix=shared_prefix)
    ids = tokenizer("the city river", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="Sequence 0 of record 1 is empty"):
        judge.score_sequences([[ids], [[]]])
    with pytest.raises(ValueError, match="Sequence 1 of record 0 is empty"):
        judge.score_sequences([[ids, []]])
    with pytest.raises(ValueError, match="Sequence 0 of record 0 is empty"):
        judge.score_sequences([[[]]])
    with torch.no_grad():
        alone = model(torch.tensor([ids])).logits[0, 0].item()
    assert judge.score_sequences([[ids]]) == pytest.approx([alone], abs=1e-5)


def test_disrm_end_to_end_through_the_cli(paths, capsys):
    root = paths["root"]
    common = [
        "eval",
        "--model-path",
        paths["disrm"],
        "--data-path",
        paths["bench"],
        "--is-disrm",
        "--max-length",
        "300",
    ]
    assert main(common + ["--save-path", str(root / "dis1"), "--batch-size", "1"]) == 0
    assert "| Model | LongQA |" in capsys.readouterr().out
    assert main(common + ["--save-path", str(root / "dis4"), "--batch-size", "4"]) == 0
    one = json.loads((root / "dis1" / "results.json").read_text())
    four = json.loads((root / "dis4" / "results.json").read_text())
    assert one["model_type"] == "DisRM" and one["auc_source"] == "disrm_scores" and one["auc_pairs"] == 7
    assert one["unparseable"]["total"] == 0  # scores always give a ranking
    for key in ("tasks", "same", "diff", "pairwise_avg", "rank", "rank_avg", "length", "average", "truncated"):
        assert one[key] == four[key], key
    assert one["auc"] == pytest.approx(four["auc"])
    _compare_predictions(_lines(root / "dis1"), _lines(root / "dis4"))
    # Recompute the headline numbers from the saved per-record scores, independently of the metrics module.
    lines = _lines(root / "dis1")
    pairwise = [p for p in lines if p["tasktype"] == "PairWise"]
    right = [p["scores"][p["order"].index(0)] > p["scores"][p["order"].index(1)] for p in pairwise]
    assert one["pairwise_avg"] == pytest.approx(sum(right) / len(right))
    for p in lines:
        by_score = sorted(range(len(p["scores"])), key=lambda i: -p["scores"][i])
        assert [p["order"][i] for i in by_score] == sorted(p["order"]) or not p["correct"]


def test_cli_rejects_bad_flags(paths):
    with pytest.raises(SystemExit):
        main(["eval", "--model-path", paths["disrm"], "--data-path", paths["bench"], "--formats", "Pointwise"])
    with pytest.raises(SystemExit):
        main(["eval", "--data-path", paths["bench"]])
