"""Any preference dataset of the data layer can be evaluated pairwise (chosen vs each rejected)."""

import json

import pytest

from trl_longrm.evaluation import EvalConfig, ScriptedJudge, evaluate_reward_model, load_preference_records


ROWS = [
    {"prompt": "Capital of France?", "chosen": "GOOD Paris", "rejected": "Lyon"},
    {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "GOOD 4", "rejected": ["5", "BAD 4"]},
    {"prompt": "Colour of the sky?", "chosen": "GOOD blue", "rejected": ["green"]},
]


def _prefers_good_unless_bad(request):
    """Picks the response starting with GOOD, except that BAD responses fool it."""
    fooled = [i for i, r in enumerate(request.responses) if r.startswith("BAD")]
    pick = fooled[0] if fooled else next(i for i, r in enumerate(request.responses) if r.startswith("GOOD"))
    return f"[[{'AB'[pick]}]]"


def test_preference_file_is_evaluated_pairwise(tmp_path):
    # Mixed prompt kinds in one file would not load; write two files of one kind each and check the first.
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS[::2]) + "\n")
    records = load_preference_records(str(path))
    assert [r.id for r in records] == ["prefs/0-0", "prefs/1-0"]
    assert records[0].prompt_messages == [{"role": "user", "content": "Capital of France?"}]
    assert records[0].candidates == ["GOOD Paris", "Lyon"]

    conv = tmp_path / "conv.jsonl"
    conv.write_text(json.dumps(ROWS[1]) + "\n")
    config = EvalConfig(model_path="scripted", data_path=str(conv), save_path=str(tmp_path / "out"))
    assert config.resolved_data_format() == "preference"
    results = evaluate_reward_model(config, judge=ScriptedJudge(_prefers_good_unless_bad))
    # Two records (one per rejected response): "5" loses to GOOD, "BAD 4" fools the judge.
    assert results["counts"]["records"] == 2 and results["tasks"] == {"conv": 0.5}
    assert results["pairwise_avg"] == 0.5 and results["average"] == 0.5
    assert results["same"] is None and results["diff"] is None and results["length"] == {}
    assert results["rank_avg"] is None


def test_preference_data_refuses_bestofn_only(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    config = EvalConfig(model_path="m", data_path=str(path), formats=["BestOfN"], save_path=str(tmp_path / "o"))
    with pytest.raises(ValueError, match="only has PairWise records"):
        evaluate_reward_model(config, judge=ScriptedJudge(_prefers_good_unless_bad))


def test_real_longrm_sample(shared_sample_path, tmp_path):
    config = EvalConfig(
        model_path="scripted", data_path=str(shared_sample_path), split="test", save_path=str(tmp_path / "out")
    )
    assert config.resolved_data_format() == "preference"
    # A judge that prefers the longer judgment (a scripted stand-in: a tiny model would spend ~10 s tokenising).
    judge = ScriptedJudge(lambda r: "[[A]]" if len(r.responses[0]) >= len(r.responses[1]) else "[[B]]")
    results = evaluate_reward_model(config, judge=judge)
    # 2 test rows with 4 rejected judgments each.
    assert results["counts"]["records"] == 8 and len(judge.judged) == 8
    records = load_preference_records(str(shared_sample_path), split="test")
    assert [m["role"] for m in records[0].prompt_messages] == ["system", "user"]
    assert records[0].candidates[0].startswith("[Analysis]")
    longer = [len(r.candidates[0]) >= len(r.candidates[1]) for r in records]
    assert results["pairwise_avg"] == sum(longer) / 8


def test_preference_rows_with_template_arguments_are_refused(tmp_path):
    """The judges render their own prompts: a row's `tools` / `chat_template_kwargs` would be lost, so it is refused;
    empty ones are not arguments and pass."""
    row = {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "chosen": "4",
        "rejected": ["5"],
        "chat_template_kwargs": {"enable_thinking": None},
    }
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "chat_template_kwargs": {"enable_thinking": False}}))
    with pytest.raises(ValueError, match=r"p\.jsonl row 1: .*`tools` / `chat_template_kwargs`"):
        load_preference_records(str(path))
    path.write_text(json.dumps(row) + "\n")
    assert [r.candidates for r in load_preference_records(str(path))] == [["4", "5"]]
