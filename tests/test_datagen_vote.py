"""Consistency majority voting (`trl_longrm.datagen.consensus` and the `vote` step): LongRM's released rules on its own
sample, and the rules' settings on hand-made scores."""

import pytest

from trl_longrm.datagen.consensus import (
    DROP_NO_CONSENSUS,
    DROP_NO_VALID,
    DROP_TIED,
    LONGRM_RULES,
    UNPARSABLE,
    VoteRules,
    score_counts,
    vote_scores,
)


def _sample_rows(path):
    from datasets import load_from_disk

    sample = load_from_disk(str(path))
    return [(split, row) for split in sample for row in sample[split]]


def test_vote_reproduces_longrm_sample(shared_sample_path):
    """On every row of the released sample (train, eval, test), the vote on its `scores` gives its `conf`,
    `chosen_model`, `reject_models`, and so the order of its `rejects` (each judge's text read off the row)."""
    rows = _sample_rows(shared_sample_path)
    assert len(rows) == 20
    for split, row in rows:
        verdict = vote_scores(row["scores"], LONGRM_RULES)
        where = f"{split} row {row['index']}"
        assert verdict.dropped is None, where
        assert verdict.conf == row["conf"], where
        assert verdict.chosen == row["chosen_model"], where
        assert verdict.rejected == row["reject_models"], where
        # The consensus is the chosen judge's score (a -1 never forms it).
        assert verdict.consensus == row["scores"][row["chosen_model"]] != UNPARSABLE, where
        texts = {row["chosen_model"]: row["chosen"], **dict(zip(row["reject_models"], row["rejects"], strict=True))}
        assert [texts[judge] for judge in verdict.rejected] == row["rejects"], where
        assert texts[verdict.chosen] == row["chosen"], where


def test_sample_rejects_mostly_agree(shared_sample_path):
    """The figures docs/data.md quotes: of the 64 rejected judgments of the 16 training rows, 45 carry the chosen
    one's score, 14 of the first two of each row (why recipes train on the first V = 2)."""
    rows = [row for split, row in _sample_rows(shared_sample_path) if split == "train"]
    same = [
        [row["scores"][judge] == row["scores"][row["chosen_model"]] for judge in row["reject_models"]] for row in rows
    ]
    assert sum(map(len, same)) == 64
    assert sum(sum(flags) for flags in same) == 45
    assert sum(sum(flags[:2]) for flags in same) == 14


RULES = VoteRules(judge_priority=("a", "b", "c", "d", "e"))


def test_hand_computed_votes():
    # 3 x 7 against 1 x 2 and an unparsable one: b is the first of the consensus; c, e disagree (priority order).
    verdict = vote_scores({"a": 2, "b": 7, "c": -1, "d": 7, "e": 7}, RULES)
    assert (verdict.consensus, verdict.chosen, verdict.rejected, verdict.conf) == (
        7,
        "b",
        ["a", "c", "d", "e"],
        [3, 1, 1],
    )
    # Two -1 judgments agree with each other but never form a consensus: the 2 x 5 does.
    verdict = vote_scores({"a": -1, "b": -1, "c": 5, "d": 5, "e": 1}, RULES)
    assert (verdict.chosen, verdict.rejected) == ("c", ["a", "b", "e", "d"])
    assert score_counts([-1, -1, 5, 5, 1]) == [2, 2, 1]


def test_drops_and_their_reasons():
    assert vote_scores({"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}, RULES).dropped == DROP_NO_CONSENSUS
    assert vote_scores({"a": 1, "b": 1, "c": 3, "d": 3, "e": 5}, RULES).dropped == DROP_TIED
    assert vote_scores(dict.fromkeys("abcde", -1), RULES).dropped == DROP_NO_VALID
    # The same tie broken by priority: a's cluster.
    tie = VoteRules(judge_priority=RULES.judge_priority, on_tie="priority")
    assert vote_scores({"a": 1, "b": 3, "c": 3, "d": 1, "e": 5}, tie).chosen == "a"
    # Only disagreeing judgments rejected: a unanimous response has none (an SFT row, no preference row).
    strict = VoteRules(judge_priority=RULES.judge_priority, rejected="disagreeing")
    unanimous = vote_scores(dict.fromkeys("abcde", 8), strict)
    assert (unanimous.dropped, unanimous.chosen, unanimous.rejected) == (None, "a", [])
    assert vote_scores({"a": 8, "b": 8, "c": 8, "d": 2, "e": 8}, strict).rejected == ["d"]


def test_tolerance_and_min_agreement():
    near = VoteRules(judge_priority=RULES.judge_priority, tolerance=1, min_agreement=3)
    # 6, 7, 7 agree within 1; 3 and 9 do not (9 is 2 from 7). The consensus score is the chosen judgment's.
    verdict = vote_scores({"a": 3, "b": 6, "c": 7, "d": 9, "e": 7}, near)
    assert (verdict.consensus, verdict.chosen, verdict.agreeing) == (6, "b", ["b", "c", "e"])
    assert verdict.rejected == ["a", "d", "c", "e"]
    assert vote_scores({"a": 3, "b": 6, "c": 9, "d": 9, "e": 1}, near).dropped == DROP_NO_CONSENSUS


def test_rules_refuse_what_they_cannot_honour():
    with pytest.raises(ValueError, match="missing \\['e'\\], unknown \\['x'\\]"):
        vote_scores({"a": 1, "b": 1, "c": 1, "d": 1, "x": 1}, RULES)
    with pytest.raises(ValueError, match="reject_order"):
        VoteRules(judge_priority=("a", "b"), reject_order=("a", "c"))
    with pytest.raises(ValueError, match="on_tie"):
        VoteRules(judge_priority=("a", "b"), on_tie="first")


def test_vote_step_rebuilds_the_sample_rows(shared_sample_path, tmp_path):
    """The `vote` step on the sample's judgments (each judge's text and score, in alphabetical order of the judges)
    with LongRM's rules writes each row's `chosen`, `rejects` (in order), `conf`, `chosen_model`, `reject_models` and
    `scores`, and its SFT row's `golden` is the chosen judgment."""
    from datagen_helpers import read_jsonl, write_jsonl

    from trl_longrm.datagen.consensus import LONGRM_RULES
    from trl_longrm.datagen.vote import VoteConfig, vote

    rows = _sample_rows(shared_sample_path)
    records = []
    for _, row in rows:
        texts = {row["chosen_model"]: row["chosen"], **dict(zip(row["reject_models"], row["rejects"], strict=True))}
        judges = sorted(texts)
        records.append({
            "id": str(row["index"]), "question": row["query"], "long_context": row["context"],
            "responses": [{"id": "r0", "model": "sample", "text": row["chat_template"][-1]["content"][-300:]}],
            "judgments": [[{"judge": j, "text": texts[j], "score": row["scores"][j]} for j in judges]],
        })  # fmt: skip
    judged = write_jsonl(tmp_path / "judged.jsonl", records)
    config = VoteConfig(input=judged, sft_output=str(tmp_path / "sft.jsonl"), simpo_output=str(tmp_path / "simpo.jsonl"),
                        judge_priority=list(LONGRM_RULES.judge_priority), reject_order=list(LONGRM_RULES.reject_order))  # fmt: skip
    summary = vote(config)
    simpo, sft = read_jsonl(tmp_path / "simpo.jsonl"), read_jsonl(tmp_path / "sft.jsonl")
    assert summary["written"] == len(simpo) == len(sft) == 20 and summary["dropped"] == {}
    for (_, row), out, sft_row in zip(rows, simpo, sft, strict=True):
        assert out["id"] == f"{row['index']}/r0"
        assert (out["chosen"], out["rejects"]) == (row["chosen"], row["rejects"])
        assert (out["conf"], out["chosen_model"], out["reject_models"]) == (
            row["conf"],
            row["chosen_model"],
            row["reject_models"],
        )
        assert out["scores"] == row["scores"] and sft_row["golden"] == row["chosen"]
        assert (
            out["chat_template"][-1]["content"].count(row["context"]) == 1
        )  # the long context, in the judge's prompt


def test_vote_step_counts_drops_by_reason(tmp_path):
    from datagen_helpers import read_jsonl, write_jsonl

    from trl_longrm.datagen.vote import VoteConfig, vote

    def judged(scores):
        return [
            {"judge": judge, "text": f"[Analysis] {judge}. [Score: {score}]", "score": score}
            for judge, score in scores.items()
        ]

    record = {
        "id": "q", "question": "Q?", "long_context": "The context.",
        "responses": [{"id": f"r{i}", "model": "m", "text": f"answer {i}"} for i in range(4)],
        "judgments": [judged({"a": 7, "b": 7, "c": 2}), judged({"a": 1, "b": 5, "c": 9}), judged({"a": -1, "b": -1, "c": -1}),
                      judged({"a": 3, "b": 8, "c": 8})],
    }  # fmt: skip
    # Two more responses whose agreeing judges write the very same text: such a "rejected" judgment rejects nothing.
    same = [{"judge": judge, "text": "Response: 3/3 correct.\n[[9]]", "score": 9} for judge in "abc"]
    record["responses"] += [
        {"id": "r4", "model": "m", "text": "answer 4"},
        {"id": "r5", "model": "m", "text": "answer 5"},
    ]
    record["judgments"] += [same[:2] + [{"judge": "c", "text": "No score.", "score": -1}], same]
    path = write_jsonl(tmp_path / "judged.jsonl", [record])
    summary = vote(
        VoteConfig(input=path, simpo_output=str(tmp_path / "simpo.jsonl"), sft_output=str(tmp_path / "sft.jsonl"))
    )
    rows = read_jsonl(tmp_path / "simpo.jsonl")
    assert summary["dropped"] == {"no_consensus": 1, "no_parsable_score": 1, "no_rejected_judgment_preference_row": 1}
    assert summary["identical_rejects_removed"] == 3
    # Judges in the records' order (a, b, c) are the priority: b chosen where a disagrees.
    assert [(r["chosen_model"], r["reject_models"]) for r in rows] == [
        ("a", ["c", "b"]),
        ("b", ["a", "c"]),
        ("a", ["c"]),
    ]
    assert [r["id"] for r in read_jsonl(tmp_path / "sft.jsonl")] == ["q/r0", "q/r3", "q/r4", "q/r5"]
