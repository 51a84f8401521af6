"""Metrics against hand-computed expectations: a scripted judge with fixed verdicts (unparseable ones included)."""

import json
from fractions import Fraction

import pytest

from trl_longrm.evaluation import (
    EvalConfig,
    JudgeOutput,
    ScriptedJudge,
    compute_auc,
    compute_metrics,
    evaluate_reward_model,
    load_benchmark,
    make_toy_benchmark,
    score_ranking,
    truncate_head_tail,
)
from trl_longrm.evaluation.prompts import (
    build_judge_messages,
    build_pointwise_messages,
    parse_pairwise_verdict,
    parse_pointwise_score,
    parse_ranking_verdict,
    ranks_from_scores,
    shuffled_order,
)


# What the scripted judge does with each record of a 2-task toy benchmark (4 PairWise + 3 BestOfN per task).
PLAN = {
    "LongQA/longqa-0000": "right",
    "LongQA/longqa-0001": "wrong",
    "LongQA/longqa-0002": "garbage",
    "LongQA/longqa-0003": "right",
    "LongQA/longqa-0004": "right",  # Rank2
    "LongQA/longqa-0005": "swap_top",  # Rank3: 1 of 3 positions right
    "LongQA/longqa-0006": "incomplete",  # Rank4: names 2 of 4 labels -> unparseable
    "Math/math-0000": "right",
    "Math/math-0001": "right",
    "Math/math-0002": "wrong",
    "Math/math-0003": "right",
    "Math/math-0004": "reverse",  # Rank2: 0 of 2
    "Math/math-0005": "right",  # Rank3
    "Math/math-0006": "swap_top",  # Rank4: 2 of 4
}
# P(chosen) that the scripted judge reports for the PairWise records (for the AUC).
P_CHOSEN = dict(zip([k for k in PLAN if int(k[-1]) < 4], [0.9, 0.3, 0.6, 0.8, 0.7, 0.55, 0.2, 0.65]))


def _letters(positions):
    return "".join(chr(ord("A") + p) for p in positions)


def make_scripted_judge(records):
    """Answers by content: it looks up each displayed response's gold rank in the benchmark file."""
    candidates = {r.id: r.candidates for r in records}

    def respond(request):
        gold = [candidates[request.record_id].index(text) for text in request.responses]
        best_first = sorted(range(len(gold)), key=gold.__getitem__)
        action = PLAN[request.record_id]
        if action == "garbage":
            return "I cannot decide between these."
        if not request.ranking:
            pick = best_first[0] if action == "right" else best_first[1]
            probs = [0.0, 0.0]
            probs[best_first[0]] = P_CHOSEN[request.record_id]
            probs[best_first[1]] = 1 - P_CHOSEN[request.record_id]
            # The format is quoted first: the last verdict must win.
            return JudgeOutput(text=f"Format: [[A]] or [[B]]. Verdict: [[{_letters([pick])}]]", verdict_probs=probs)
        if action == "swap_top":
            best_first[0], best_first[1] = best_first[1], best_first[0]
        elif action == "reverse":
            best_first = best_first[::-1]
        elif action == "incomplete":
            best_first = best_first[:2]
        return "[Analysis] fine.\n[Ranking]\n[[" + ">".join(_letters([p]) for p in best_first) + "]]"

    return ScriptedJudge(respond)


def test_metrics_match_hand_computation(tmp_path):
    data = make_toy_benchmark(tmp_path / "bench", tasks=["LongQA", "Math"], lengths=("4k", "8k"))
    config = EvalConfig(
        model_path="scripted", data_path=str(data), tasks=["LongQA", "Math"], save_path=str(tmp_path / "out")
    )
    judge = make_scripted_judge(load_benchmark(data, config.tasks, config.formats))
    results = evaluate_reward_model(config, judge=judge)

    assert results["tasks"] == {"LongQA": 0.5, "Math": 0.75}
    assert results["same"] == 0.5 and results["diff"] == 0.75
    assert results["pairwise_avg"] == 5 / 8
    # LongQA lengths cycle 4k, 8k, ...; Math's start at 8k.
    assert results["length"] == {"4k": 0.75, "8k": 0.5}
    assert results["rank"] == pytest.approx({"2": 0.5, "3": 2 / 3, "4": 0.25})
    assert results["rank_exact"] == {"2": 0.5, "3": 0.5, "4": 0.0}
    assert results["rank_avg"] == pytest.approx(float(Fraction(17, 36)))
    assert results["rank_exact_avg"] == pytest.approx(1 / 3)
    assert results["average"] == pytest.approx(float(Fraction(47, 84)))
    assert results["unparseable"] == {"total": 2, "PairWise": 1, "BestOfN": 1}
    assert results["counts"]["records"] == 14 and results["counts"]["length"] == {"4k": 4, "8k": 4}

    # AUC by its definition: the fraction of (chosen, rejected) score pairs ranked the right way round.
    # The unparseable answer came without probabilities, so 7 of the 8 PairWise records enter the AUC.
    positives = [p for key, p in P_CHOSEN.items() if PLAN[key] != "garbage"]
    negatives = [1 - p for p in positives]
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    assert results["auc_source"] == "grm_verdict_probs" and results["auc_pairs"] == 7
    assert results["auc"] == pytest.approx(wins / (len(positives) * len(negatives)))

    # The report files carry the same numbers.
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["rank_avg"] == results["rank_avg"]
    csv_rows = {
        line.split(",")[1]: line.split(",")[2] for line in (tmp_path / "out" / "results.csv").read_text().splitlines()
    }
    assert float(csv_rows["PairWise Avg."]) == round(5 / 8, 5) and float(csv_rows["Rank Avg."]) == round(17 / 36, 5)
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "| 50.0 | 75.0 |" in markdown and "Unparseable verdicts (counted wrong): 2" in markdown
    assert (tmp_path / "out" / "length_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Each prediction line records the shown order, the raw verdict and its parse.
    lines = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    garbage = next(p for p in lines if p["id"] == "LongQA/longqa-0002")
    assert garbage["output"] == "I cannot decide between these." and garbage["predicted_ranks"] is None
    assert sorted(garbage["order"]) == [0, 1] and garbage["correct"] is False


# Pointwise scores per record, by gold rank of the response (best first); None: a judgment without a score. The
# PairWise record 0003 comes with expected scores (floats), the others with the parsed integers only.
POINTWISE_PLAN = {
    "LongQA/longqa-0000": [8, 2],  # right
    "LongQA/longqa-0001": [3, 6],  # wrong
    "LongQA/longqa-0002": [7, None],  # unparseable
    "LongQA/longqa-0003": [5.2, 4.9],  # right, from the expected scores (both parsed as 5)
    "LongQA/longqa-0004": [9, 0],  # Rank2: exact
    "LongQA/longqa-0005": [7, 8, 1],  # Rank3: top two swapped, 1 of 3 positions right
    "LongQA/longqa-0006": [9, 6, 3, 0],  # Rank4: exact
}


def test_pointwise_judge_metrics_match_hand_computation(tmp_path):
    data = make_toy_benchmark(tmp_path / "bench", tasks=["LongQA"], lengths=("4k",))
    records = load_benchmark(data, ["LongQA"], ["PairWise", "BestOfN"])
    candidates = {r.id: r.candidates for r in records}

    def respond(request):
        plan = POINTWISE_PLAN[request.record_id]
        shown = [plan[candidates[request.record_id].index(text)] for text in request.responses]
        judgments = [f"Looks fine. [[{round(s)}]]" if s is not None else "No idea." for s in shown]
        expected = shown if any(isinstance(s, float) for s in shown) else None
        return JudgeOutput(judgments=judgments, scores=expected)

    config = EvalConfig(model_path="scripted", data_path=str(data), tasks=["LongQA"], save_path=str(tmp_path / "out"))
    results = evaluate_reward_model(config, judge=ScriptedJudge(respond))
    assert results["pairwise_avg"] == 0.5
    assert results["rank"] == pytest.approx({"2": 1.0, "3": 1 / 3, "4": 1.0})
    assert results["rank_exact"] == {"2": 1.0, "3": 0.0, "4": 1.0}
    assert results["unparseable"] == {"total": 1, "PairWise": 1, "BestOfN": 0}
    # chosen {8, 3, 5.2} vs rejected {2, 6, 4.9}: 8 beats all three, 3 beats one, 5.2 beats two -> 6 / 9.
    assert results["auc_source"] == "grm_pointwise_scores" and results["auc_pairs"] == 3
    assert results["auc"] == pytest.approx(6 / 9)
    lines = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    unparsed = next(p for p in lines if p["id"] == "LongQA/longqa-0002")
    assert unparsed["predicted_ranks"] is None and unparsed["scores"] is None and "No idea." in unparsed["judgments"]


def test_pointwise_prompt_and_score_parser():
    system, user = build_pointwise_messages("TASK TEXT", "the answer")
    assert "[[7]]" in system["content"] and "0 (worst) to 9 (best)" in system["content"]
    assert user["content"].startswith("# Task\nTASK TEXT\n\n# Response\nthe answer\n# End of Response\n\n")
    assert parse_pointwise_score("Format [[7]]. Mine: [[ 3 ]]") == 3  # the last score wins
    assert parse_pointwise_score("[[10]]") is None and parse_pointwise_score("[[A]]") is None
    assert parse_pointwise_score("no score") is None


def test_parsers_and_rank_scoring():
    assert parse_pairwise_verdict("[[B]] on reflection [[A]]") == [0, 1]
    assert parse_pairwise_verdict("[[ B ]]") == [1, 0]
    assert parse_pairwise_verdict("[[C]]") is None
    assert parse_ranking_verdict("[[C > A > B]]", 3) == [1, 2, 0]
    assert parse_ranking_verdict("[[A>B>C>D]]", 3) is None  # a label too many
    assert parse_ranking_verdict("[[A>A>B]]", 3) is None
    assert parse_ranking_verdict("[[B>A]]", 2) == [1, 0]
    # LongRM's position-wise ratio: gold ranks [0, 2, 1, 3] vs predicted [0, 1, 2, 3] match at positions 0 and 3.
    assert score_ranking([0, 2, 1, 3], [0, 1, 2, 3]) == (0.5, False)
    assert score_ranking([1, 0], [1, 0]) == (1.0, True)
    assert score_ranking([1, 0], None) == (0.0, False)
    assert ranks_from_scores([0.5, 3.0, -2.0, 1.0]) == [2, 0, 3, 1]


def test_judge_prompts_label_every_response():
    pair = build_judge_messages("TASK TEXT", ["first", "second"])
    assert "[[A]]" in pair[0]["content"] and "TASK TEXT" in pair[1]["content"]
    assert pair[1]["content"].index("# Response A\nfirst") < pair[1]["content"].index("# Response B\nsecond")
    rank = build_judge_messages("T", ["x", "y", "z"], ranking=True)
    assert "[[C>B>A]]" in rank[0]["content"] and "# Response C\nz" in rank[1]["content"]
    with pytest.raises(ValueError, match="exactly 2"):
        build_judge_messages("T", ["x", "y", "z"])


def test_shuffle_depends_only_on_seed_and_id():
    orders = [tuple(shuffled_order(42, f"LongQA/{i}", 2)) for i in range(200)]
    assert orders == [tuple(shuffled_order(42, f"LongQA/{i}", 2)) for i in range(200)]
    assert 60 < orders.count((1, 0)) < 140  # both orders occur, about half each
    assert orders != [tuple(shuffled_order(43, f"LongQA/{i}", 2)) for i in range(200)]
    assert sorted(shuffled_order(1, "x", 4)) == [0, 1, 2, 3]


def test_truncation_matches_longrm_rule():
    ids = list(range(131_080))
    # LongRM: prompt_token[:65536] + prompt_token[5 - 65536:]
    reference = ids[:65536] + ids[5 - 65536 :]
    assert truncate_head_tail(ids, 131_072) == (reference, True)
    assert truncate_head_tail(ids[:100], 131_072) == (ids[:100], False)


def test_disrm_auc_and_mixed_sources():
    ranked = {"predicted_ranks": [0, 1]}  # a parsed verdict (a DisRM's always is)
    predictions = [
        {"tasktype": "PairWise", "order": [0, 1], "scores": [2.0, 1.0], **ranked},  # chosen 2.0, rejected 1.0
        {"tasktype": "PairWise", "order": [1, 0], "scores": [0.5, 1.5], **ranked},  # chosen 1.5, rejected 0.5
        {"tasktype": "PairWise", "order": [1, 0], "scores": [1.8, 0.2], **ranked},  # chosen 0.2, rejected 1.8
        {"tasktype": "BestOfN", "order": [2, 0, 1], "scores": [9.0, 9.0, 9.0], **ranked},  # not part of the AUC
    ]
    # chosen {2.0, 1.5, 0.2} vs rejected {1.0, 0.5, 1.8}: 2.0 beats all three, 1.5 beats two, 0.2 none -> 5 / 9.
    assert compute_auc(predictions) == (pytest.approx(5 / 9), "disrm_scores", 3)
    with pytest.raises(ValueError, match="mix AUC sources"):
        compute_auc(predictions + [{"tasktype": "PairWise", "order": [0, 1], "verdict_probs": [0.4, 0.6], **ranked}])
    assert compute_auc([{"tasktype": "PairWise", "order": [0, 1], "output": "x"}]) == (None, None, 0)


def test_auc_counts_only_parsed_verdicts():
    """A judge with no parseable verdict has 0% accuracy and no AUC (it reported 0.879 from its verdict
    probabilities); with some parsed, the AUC is over those, and says how many."""
    unparsed = [{"tasktype": "PairWise", "order": [0, 1], "verdict_probs": [0.9 - i / 10, 0.1 + i / 10],
                 "predicted_ranks": None, "task": "LongQA", "length": "4k", "subtype": "same", "output": "?"}
                for i in range(4)]  # fmt: skip
    assert compute_auc(unparsed) == (None, None, 0)
    results = compute_metrics(unparsed, ["LongQA"])
    assert results["auc"] is None and results["auc_pairs"] == 0 and results["unparseable"]["total"] == 4
    parsed = [dict(p, predicted_ranks=[0, 1]) for p in unparsed[:2]]
    assert compute_auc(parsed + unparsed[2:]) == (1.0, "grm_verdict_probs", 2)
