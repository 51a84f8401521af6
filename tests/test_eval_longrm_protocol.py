"""`--protocol longrm`: LongRM's evaluator reproduced from the same judge outputs.

The reference for the candidate order is written here from its description (the global `random` module, seeded once
per task file, shuffling the file's selected records, then one permutation per record in that shuffled order); the
parses and the expected numbers are written out by hand.
"""

import dataclasses
import json
import random

import pytest

from trl_longrm.evaluation import EvalConfig, ScriptedJudge, evaluate_reward_model, load_benchmark, truncate_head_tail
from trl_longrm.evaluation.protocols import parse_pairwise_longrm, parse_ranking_longrm, score_ranking_longrm


def _pair(rid, subtype, length, chosen="the right answer", rejected="a wrong answer"):
    return {
        "id": rid,
        "prompt_template": [{"role": "system", "content": "Judge."}, {"role": "user", "content": f"Task {rid}?"}],
        "chosen": f"{chosen} ({rid})",
        "rejected": f"{rejected} ({rid})",
        "tasktype": "PairWise",
        "subtype": subtype,
        "ctx_length_for_length": length,
        "source": "fixture",
    }


def _best(rid, n, subtype=None):
    return {
        "id": rid,
        "prompt_template": [{"role": "user", "content": f"Task {rid}?"}],
        "candidates": [f"candidate {i} of {rid}" for i in range(n)],
        "tasktype": "BestOfN",
        "subtype": str(n) if subtype is None else subtype,
        "ctx_length_for_length": "8k",
        "source": "fixture",
    }


# Two task files in the real record layout. Each record names what the scripted judge answers (see `_answer`).
FILES = {
    "LongQA": [
        (_pair("q1", "same", "4k"), "right"),
        (_pair("q2", "same", "8k"), "wrong"),
        (_best("q3", 3), "right"),
        (_pair("q4", "Qwen|Llama", "8k"), "right_then_wrong"),  # `[[X]] ... [[Y]]`: the first occurrence of [[A]] wins
        (_best("q5", 4), "literal:[[B>A>C]]"),  # partial: 3 of 4 labels
        (_pair("q6", "Qwen|Llama", "16k"), "literal:no verdict here"),
        (_best("q7", 2), "literal:[Assistant B > Assistant A]"),
    ],
    "Math": [
        (_pair("m1", "same", "4k"), "literal:[[ A ]]"),  # not the substring [[A]]: no verdict
        (_best("m2", 3), "reverse"),  # reversed 3-ranking: exactly the middle matches
        (_best("m3", 2), "literal:[[A>B>C]]"),  # one letter too many: a longer order, scored over 2 positions
        (_best("m4", 3), "literal:[[A>C]]"),  # index 1 missing: no ranking
        (_best("m5", 5, subtype="5"), "right"),  # a subtype outside 2/3/4: only in the Rank Avg. denominator
        (_best("m6", 3), "literal:" + "x>" * 10 + "[[A>B>C]]"),  # more than 10 pieces on `>`: no ranking
        (_best("m7", 3), "literal:[[a>b>c]]"),  # lower case: no such indices
        (_best("m8", 3), "literal:[A>B] and later [[B>A>C]]"),  # the first bracketed group counts
    ],
}
PLAN = {f"{task}/{row['id']}": plan for task, rows in FILES.items() for row, plan in rows}


def _write(root):
    root.mkdir()
    for task, rows in FILES.items():
        (root / f"{task}.jsonl").write_text("".join(json.dumps(row) + "\n" for row, _ in rows))
    return root


def reference_orders(rows, formats):
    """LongRM's order per record id, as its evaluator draws it for one task file."""
    random.seed(42)
    kept = [row for row in rows if row["tasktype"] in formats]
    random.shuffle(kept)
    orders = {}
    for row in kept:
        order = list(range(len(row["candidates"]) if row["tasktype"] == "BestOfN" else 2))
        random.shuffle(order)
        orders[row["id"]] = order
    return orders


def _letters(positions):
    return "".join(chr(ord("A") + p) for p in positions)


def _answer(request, candidates):
    plan = PLAN[request.record_id]
    if plan.startswith("literal:"):
        return plan.removeprefix("literal:")
    gold = [candidates[request.record_id].index(text) for text in request.responses]
    best_first = sorted(range(len(gold)), key=gold.__getitem__)
    if plan == "reverse":
        best_first = best_first[::-1]
    if request.ranking:
        return "[Analysis] ...\n[Ranking]\n[[" + ">".join(_letters([p]) for p in best_first) + "]]"
    right, wrong = _letters(best_first[:1]), _letters(best_first[1:])
    return {
        "right": f"[[{right}]]",
        "wrong": f"[[{wrong}]]",
        "right_then_wrong": f"Between [[{right}]] and [[{wrong}]], my final verdict: [[{wrong}]]",
    }[plan]


def _judge():
    candidates = {}
    for task, rows in FILES.items():
        for row, _ in rows:
            candidates[f"{task}/{row['id']}"] = row.get("candidates") or [row["chosen"], row["rejected"]]
    return ScriptedJudge(lambda request: _answer(request, candidates))


def _expected_parse(rid, order):
    """The parse of each record's output, written out by hand (None: no verdict)."""
    plan = PLAN[rid]
    true_ranks = list(order)
    literal = {
        "[[B>A>C]]": [1, 0, 2],
        "no verdict here": None,
        "[Assistant B > Assistant A]": [1, 0],
        "[[ A ]]": None,
        "[[A>B>C]]": [0, 1, 2],
        "[[A>C]]": None,
        "x>" * 10 + "[[A>B>C]]": None,
        "[[a>b>c]]": None,
        "[A>B] and later [[B>A>C]]": [0, 1],
    }
    if plan.startswith("literal:"):
        return literal[plan.removeprefix("literal:")]
    if plan == "right_then_wrong":
        return [0, 1]  # both [[A]] and [[B]] occur: [[A]] wins, whichever is right
    if plan == "right":
        return true_ranks
    if plan == "wrong":
        return true_ranks[::-1]
    if plan == "reverse":
        return [len(order) - 1 - r for r in true_ranks]
    raise AssertionError(plan)


def test_parsers_follow_longrm_rules():
    assert parse_pairwise_longrm("[[B]] first, then [[A]]") == [0, 1]  # [[A]] anywhere wins over [[B]]
    assert parse_pairwise_longrm("[[B]]") == [1, 0]
    assert parse_pairwise_longrm("[[ A ]] [A] [[a]]") is None
    assert parse_ranking_longrm("[[C>A>B]]") == [1, 2, 0]
    assert parse_ranking_longrm("[Assistant C > Assistant A > Assistant B]") == [1, 2, 0]
    assert parse_ranking_longrm("[[assistant B>assistant A]]") == [1, 0]
    assert parse_ranking_longrm("[[assistant: B>assistant: A]]") is None  # `:` is not in the bracket pattern
    assert parse_ranking_longrm("[[B>A>D]]") is None  # index 2 absent
    assert parse_ranking_longrm("[[B>A>C]]") == [1, 0, 2]  # partial for 4 candidates: kept
    assert parse_ranking_longrm("[[A>B>C>D>E]]") == [0, 1, 2, 3, 4]
    assert parse_ranking_longrm("[[A>\nB]]") is None  # a newline stays in the piece
    assert parse_ranking_longrm("[[AB>C]]") is None  # a piece of two letters
    assert parse_ranking_longrm("[[A>B]]" + ">" * 9) is None  # 11 pieces on `>`
    assert parse_ranking_longrm("[[A>B]]" + ">" * 8) == [0, 1]  # 10 pieces: still parsed
    assert parse_ranking_longrm("A > B") is None  # no brackets


def test_record_score_counts_partial_rankings():
    assert score_ranking_longrm([2, 0, 1, 3], [2, 0, 3]) == (0.5, False)
    assert score_ranking_longrm([1, 0], [1, 0, 2]) == (1.0, False)
    assert score_ranking_longrm([1, 0], [1, 0]) == (1.0, True)
    assert score_ranking_longrm([1, 0], None) == (0.0, False)


def test_truncation_at_the_limit():
    ids = list(range(20))
    assert truncate_head_tail(ids, 20) == (ids, False)  # ours: only longer inputs are cut
    cut, truncated = truncate_head_tail(ids, 20, at_limit=True)  # LongRM: at least max_length is cut
    assert truncated and cut == list(range(10)) + list(range(15, 20))
    # LongRM's 128K numbers: the first 65,536 and the last 65,531 tokens.
    long_cut, _ = truncate_head_tail(list(range(131072)), 131072, at_limit=True)
    assert long_cut[:65536] == list(range(65536)) and long_cut[65536:] == list(range(131072 - 65531, 131072))


def _mean_or_zero(values):
    return sum(values) / len(values) if values else 0


@pytest.mark.parametrize("formats", [["PairWise", "BestOfN"], ["PairWise"]])
def test_longrm_numbers_by_hand(tmp_path, formats):
    bench = _write(tmp_path / "bench")
    config = EvalConfig(
        model_path="scripted",
        data_path=str(bench),
        save_path=str(tmp_path / "out"),
        protocol="longrm",
        formats=formats,
        tasks=["LongQA", "Math"],
    )
    results = evaluate_reward_model(config, judge=_judge())
    predictions = {
        p["id"]: p for p in map(json.loads, (tmp_path / "out" / "predictions.jsonl").read_text().splitlines())
    }

    per_record = {}
    for task, rows in FILES.items():
        orders = reference_orders([row for row, _ in rows], formats)
        for row, _ in rows:
            rid = f"{task}/{row['id']}"
            if row["tasktype"] not in formats:
                assert rid not in predictions
                continue
            order = orders[row["id"]]
            assert predictions[rid]["order"] == order, rid
            parsed = _expected_parse(rid, order)
            assert predictions[rid]["predicted_ranks"] == parsed, rid
            score = 0 if not parsed else sum(int(g == p) for g, p in zip(order, parsed)) / len(order)
            per_record[rid] = (task, row, score)
    pairwise = [(t, r, s) for t, r, s in per_record.values() if r["tasktype"] == "PairWise"]
    bestofn = [(t, r, s) for t, r, s in per_record.values() if r["tasktype"] == "BestOfN"]

    assert results["protocol"] == "longrm"
    for task in ("LongQA", "Math"):
        assert results["tasks"][task] == pytest.approx(_mean_or_zero([s for t, _, s in pairwise if t == task]))
    assert results["same"] == pytest.approx(_mean_or_zero([s for _, r, s in pairwise if r["subtype"] == "same"]))
    assert results["diff"] == pytest.approx(_mean_or_zero([s for _, r, s in pairwise if r["subtype"] != "same"]))
    assert results["pairwise_avg"] == pytest.approx(_mean_or_zero([s for _, _, s in pairwise]))
    for subtype in ("2", "3", "4"):
        expected = _mean_or_zero([s for _, r, s in bestofn if r["subtype"] == subtype])
        assert results["rank"][subtype] == pytest.approx(expected)
    # Sum over subtypes 2-4 over ALL BestOfN records (the subtype-5 record counts only in the denominator).
    rank_sum = sum(s for _, r, s in bestofn if r["subtype"] in ("2", "3", "4"))
    assert results["rank_avg"] == pytest.approx(rank_sum / len(bestofn) if bestofn else 0)
    assert list(results["length"]) == ["4k", "8k", "16k", "32k", "64k", "128k"]
    for bucket in results["length"]:
        expected = _mean_or_zero([s for _, r, s in pairwise if r["ctx_length_for_length"] == bucket])
        assert results["length"][bucket] == pytest.approx(expected)
    assert results["average"] == pytest.approx(_mean_or_zero([s for _, _, s in per_record.values()]))

    # The plan's own figures: LongQA's PairWise records score 1 (right), 0 (wrong), 1 or 0 (both verdicts written:
    # [[A]] wins, right only when the chosen answer is shown first) and 0 (no verdict); Math's one 0 ([[ A ]]).
    q4_first = reference_orders([row for row, _ in FILES["LongQA"]], formats)["q4"][0] == 0
    assert results["tasks"]["LongQA"] == pytest.approx((1 + 0 + q4_first + 0) / 4)
    assert results["tasks"]["Math"] == 0
    # A task without records in the selection reports 0 (Rank rows when only PairWise is selected).
    assert results["rank"]["2"] == (0 if formats == ["PairWise"] else results["rank"]["2"])
    # m4, m6 and m7 give no ranking.
    assert results["unparseable"]["BestOfN"] == (3 if "BestOfN" in formats else 0)


def test_longrm_predictions_do_not_resume_under_other_formats(tmp_path):
    bench = _write(tmp_path / "bench")
    kwargs = dict(
        model_path="scripted",
        data_path=str(bench),
        save_path=str(tmp_path / "out"),
        protocol="longrm",
        tasks=["LongQA", "Math"],
    )
    evaluate_reward_model(EvalConfig(**kwargs), judge=_judge())
    # The orders depend on which formats are selected, so these predictions do not hold for another selection.
    with pytest.raises(ValueError, match="formats"):
        evaluate_reward_model(EvalConfig(**kwargs, formats=["PairWise"]), judge=_judge())


def test_default_and_longrm_parse_the_same_output_differently(tmp_path):
    bench = _write(tmp_path / "bench")
    runs = {}
    for protocol in ("default", "longrm"):
        config = EvalConfig(
            model_path="scripted",
            data_path=str(bench),
            save_path=str(tmp_path / protocol),
            protocol=protocol,
            tasks=["LongQA"],
        )
        evaluate_reward_model(config, judge=_judge())
        lines = (tmp_path / protocol / "predictions.jsonl").read_text().splitlines()
        runs[protocol] = {p["id"]: p for p in map(json.loads, lines)}
    # `[[right]] ... [[wrong]]`: LongRM's rule takes [[A]] if it occurs anywhere, ours the last verdict (wrong).
    assert runs["longrm"]["LongQA/q4"]["predicted_ranks"] == [0, 1]
    assert runs["default"]["LongQA/q4"]["match_ratio"] == 0.0
    # The partial ranking of 3 labels for 4 candidates scores under LongRM's rule and is unparseable under ours.
    assert runs["default"]["LongQA/q5"]["predicted_ranks"] is None
    assert runs["longrm"]["LongQA/q5"]["predicted_ranks"] == [1, 0, 2]


def test_pointwise_is_refused_under_longrm():
    with pytest.raises(ValueError, match="pointwise"):
        EvalConfig(model_path="m", data_path="d", protocol="longrm", judge_protocol="pointwise")


def test_longrm_task_rows_use_the_files_names_whatever_the_case_typed(tmp_path):
    """`--tasks longqa MATH` under `--protocol longrm`: the rows are LongQA and Math with their records (they were
    keyed by the names typed and reported 0.0 over 0 records)."""
    bench = _write(tmp_path / "bench")
    kwargs = dict(model_path="scripted", data_path=str(bench), protocol="longrm", formats=["PairWise"])
    typed = evaluate_reward_model(EvalConfig(**kwargs, save_path=str(tmp_path / "a"), tasks=["longqa", "MATH"]),
                                  judge=_judge())  # fmt: skip
    exact = evaluate_reward_model(EvalConfig(**kwargs, save_path=str(tmp_path / "b"), tasks=["LongQA", "Math"]),
                                  judge=_judge())  # fmt: skip
    assert typed["tasks"] == exact["tasks"] and set(typed["tasks"]) == {"LongQA", "Math"}
    assert typed["counts"]["tasks"] == exact["counts"]["tasks"] and typed["counts"]["tasks"]["LongQA"] > 0


def test_missing_task_files_are_one_line_without_a_traceback(tmp_path, capsys):
    # `trl-longrm eval` in this process (`tests/test_eval_cli_errors.py` runs the installed command as a process).
    from cli_helpers import run_cli

    bench = _write(tmp_path / "bench")  # LongQA and Math only; the default --tasks asks for all seven
    code, stderr = run_cli(capsys, "eval", "--model-path", str(tmp_path / "m"), "--data-path", str(bench),
                           "--save-path", str(tmp_path / "out"))  # fmt: skip
    assert code == 1 and "Traceback" not in stderr, stderr[-2000:]
    [line] = [line for line in stderr.splitlines() if "trl-longrm: error:" in line]
    assert "the directory has the tasks ['LongQA', 'Math']" in line


# LongRM's evaluator (LCM-Lab/LongRM at bbc90f5, evaluate/evaluating/longreward_bench/utils/prompt.py), as written there:
# the reference the shipped `recipes/eval/longrm_prompts.yaml` must reproduce byte for byte.
LONGRM_PAIR_SYSTEM_PROMPT = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by two AI assistants to the user questions. "
    "You should focus on who provides a better answer to the second user question. "
    "You should choose the assistant that follows the user's instructions and answers the user's question better. Your evaluation should consider "
    "factors such as the helpfulness, relevance, accuracy, depth, creativity, and level of detail of their responses. Begin your evaluation by "
    "comparing the two responses and provide a short explanation. Avoid any position biases and ensure that the order in which the responses were "
    "presented does not influence your decision. Do not allow the length of the responses to influence your evaluation. Do not favor certain names "
    "of the assistants. Be as objective as possible. After providing your explanation, output your final verdict by strictly following this format: "
    '"[[A]]" if assistant A is better, "[[B]]" if assistant B is better.'
)  # noqa: E501
LONGRM_RANK_SYSTEM_PROMPT = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by multiple AI assistants to the user's question. "
    "You should rank {number} responses based on their quality, with the highest quality response first, followed by the next best, and so on. "
    "Consider the following factors in your evaluation: helpfulness, relevance, accuracy, depth, creativity, and level of detail. "
    "Do not allow the order in which the responses were presented to influence your decision. "
    "Your ranking should be based purely on the overall quality of each response, not on the length or the name of the assistants. "
    "After evaluating the responses, please output the ranking of the assistants in the following format: {pattern}"
    "Please reply strictly in the following format, starting with [Analysis] and ending with patterns like {pattern}:\n"
    "[Analysis]\n(your analysis)\n[Ranking]\n(your ranking in the format of {pattern})"
)  # noqa: E501


def longrm_chat_template(question, answers, kind):
    """LongRM's `get_chat_template(question, answers, type)`: its system prompt and `get_user_prompt`."""
    if kind == "rank":
        pattern = f"[[{'>'.join([chr(ord('A') + i) for i in range(len(answers))])}]]"
        system = LONGRM_RANK_SYSTEM_PROMPT.format(number=len(answers), pattern=pattern)
    else:
        system = LONGRM_PAIR_SYSTEM_PROMPT
    user = (f"[User Question]\n{question}\n\n[The Start of Assistant A's Answer]\n{answers[0]}\n[The End of Assistant A's "
            f"Answer]\n\n[The Start of Assistant B's Answer]\n{answers[1]}\n[The End of Assistant B's Answer]")  # fmt: skip
    for k in range(2, len(answers)):
        assistant = chr(ord("A") + k)
        user += f"\n\n[The Start of Assistant {assistant}'s Answer]\n{answers[k]}\n[The End of Assistant {assistant}'s Answer]"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_shipped_longrm_prompts_render_the_original_messages(tmp_path):
    """`--prompt-template recipes/eval/longrm_prompts.yaml` gives LongRM's pairwise and ranking messages byte for byte
    (the ranking format shown as `[[A>B>C]]`, the labels in display order: the `{pattern}` placeholder)."""
    from pathlib import Path

    from trl_longrm.evaluation.templates import PromptTemplate

    template = PromptTemplate.from_yaml(Path(__file__).resolve().parents[1] / "recipes" / "eval" / "longrm_prompts.yaml")
    records = load_benchmark(_write(tmp_path / "bench"), ["LongQA", "Math"], ["PairWise", "BestOfN"])
    pair = next(r for r in records if r.tasktype == "PairWise" and len(r.prompt_messages) == 2)
    rank = next(r for r in records if r.tasktype == "BestOfN" and len(r.candidates) >= 3)
    shown = [pair.candidates[1], pair.candidates[0]]
    assert template.pairwise_messages(pair.task_prompt, shown) == longrm_chat_template(pair.task_prompt, shown, "pair")
    shown = rank.candidates[::-1]
    messages = template.ranking_messages(rank.task_prompt, shown)
    assert messages == longrm_chat_template(rank.task_prompt, shown, "rank")
    assert "[[A>B>C" in messages[0]["content"]


def test_untyped_records_and_null_subtypes_are_kept_under_longrm(tmp_path):
    """LongRM's evaluator keeps a record without `tasktype` (judged as a pair, counted in the overall average only,
    whatever the formats) and a PairWise record with a null `subtype` (in Diff); the default protocol refuses them,
    naming the file, line and key."""
    untyped = {k: v for k, v in _pair("u1", "same", "4k").items() if k != "tasktype"}
    null_subtype = _pair("n1", None, "8k")
    root = tmp_path / "bench"
    root.mkdir()
    rows = [_pair("p1", "same", "4k"), untyped, null_subtype]
    (root / "LongQA.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"LongQA.jsonl, line 2: key `tasktype` is missing .*--protocol longrm"):
        load_benchmark(root, ["LongQA"], ["PairWise"])

    class Right(ScriptedJudge):
        """Always picks the chosen answer (its text says so), whatever the display order."""

        def __init__(self):
            super().__init__(lambda request: "[[A]]" if "right" in request.responses[0] else "[[B]]")

    config = EvalConfig(model_path="scripted", data_path=str(root), save_path=str(tmp_path / "out"),
                        protocol="longrm", formats=["BestOfN"], tasks=["LongQA"])  # fmt: skip
    results = evaluate_reward_model(config, judge=Right())
    predictions = {p["id"]: p for p in map(json.loads, (tmp_path / "out" / "predictions.jsonl").read_text().splitlines())}
    assert set(predictions) == {"LongQA/u1"}  # BestOfN selected: the untyped record is kept, the PairWise ones not
    assert results["average"] == 1.0 and results["pairwise_avg"] == 0 and results["counts"]["pairwise"] == 0
    config = dataclasses.replace(config, formats=["PairWise", "BestOfN"], save_path=str(tmp_path / "all"))
    results = evaluate_reward_model(config, judge=Right())
    assert results["counts"]["records"] == 3 and results["counts"]["pairwise"] == 2
    assert results["counts"]["diff"] == 1 and results["diff"] == 1.0  # the null subtype counts as not `same`
