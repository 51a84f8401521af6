"""Long-RewardBench metrics, computed from per-record predictions (the lines of `predictions.jsonl`).

Each prediction holds `order` (gold rank of the candidate shown at each position) and `predicted_ranks` (the judge's
rank for each position, or None when its verdict could not be parsed). As in LongRM, a record scores the fraction of
positions whose predicted rank matches the gold one: 0 or 1 for a PairWise record, the position-wise rank-match ratio
for a BestOfN record; an unparseable verdict scores 0. Exact-order accuracy is reported beside the ratio.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from sklearn.metrics import roc_auc_score

from trl_longrm.evaluation.config import LENGTH_BUCKETS, RANK_SUBTYPES
from trl_longrm.evaluation.protocols import score_ranking_longrm


def score_ranking(order: list[int], predicted_ranks: list[int] | None) -> tuple[float, bool]:
    """(position-wise rank-match ratio, exact match) of a predicted ranking against the gold one; (0, False) if None.

    Example:
    ```python
    >>> score_ranking([2, 0, 1], [2, 1, 0])  # only the first position is right
    (0.3333333333333333, False)
    ```
    """
    if predicted_ranks is None or len(predicted_ranks) != len(order):
        return 0.0, False
    matches = sum(int(p == g) for p, g in zip(predicted_ranks, order))
    return matches / len(order), matches == len(order)


def _mean(values: list[float]) -> float | None:
    # An empty group has no accuracy: None (not 0, which would read as a failed model).
    return sum(values) / len(values) if values else None


def _ordered_lengths(lengths: Iterable[str]) -> list[str]:
    present = set(lengths)
    return [b for b in LENGTH_BUCKETS if b in present] + sorted(present - set(LENGTH_BUCKETS))


def chosen_rejected_scores(prediction: dict) -> tuple[float, float, str] | None:
    """(chosen score, rejected score, source) of a PairWise prediction for the AUC, or None when it has none.

    Candidate scores come first (a DisRM's, or a pointwise generative judge's, which also has `judgments`); a
    pairwise generative judge's verdict probabilities otherwise.
    """
    order = prediction["order"]
    scores_source = "grm_pointwise_scores" if prediction.get("judgments") is not None else "disrm_scores"
    for key, source in (("scores", scores_source), ("verdict_probs", "grm_verdict_probs")):
        values = prediction.get(key)
        if values is not None:
            return values[order.index(0)], values[order.index(1)], source
    return None


def compute_auc(predictions: list[dict]) -> tuple[float | None, str | None, int]:
    """ROC AUC over chosen (label 1) vs rejected (label 0) scores of the PairWise predictions: (auc, source, pairs).

    Only records whose verdict was parsed count (`predicted_ranks`), as for the accuracy: a judge whose verdicts are
    unparseable has no AUC (None), however its verdict probabilities would order the pairs; `pairs` is how many
    records it is over.

    Example:
    ```python
    >>> compute_auc([{"tasktype": "PairWise", "order": [1, 0], "scores": [0.2, 0.9], "predicted_ranks": [1, 0]}])
    (1.0, 'disrm_scores', 1)
    ```
    """
    labels, values, sources = [], [], set()
    for prediction in predictions:
        if prediction["tasktype"] != "PairWise" or not prediction.get("predicted_ranks"):
            continue
        found = chosen_rejected_scores(prediction)
        if found is None:
            continue
        chosen, rejected, source = found
        labels += [1, 0]
        values += [chosen, rejected]
        sources.add(source)
    if not labels:
        return None, None, 0
    if len(sources) > 1:
        raise ValueError(f"Predictions mix AUC sources {sorted(sources)}; evaluate one kind of model per save path.")
    return float(roc_auc_score(labels, values)), sources.pop(), len(labels) // 2


def compute_metrics(predictions: list[dict], tasks: list[str], protocol: str = "default") -> dict:
    """The paper's table (and more) from predictions.

    Records without a subtype or length (from a plain preference dataset) are left out of Same/Diff and of the
    length buckets only. Keys: `tasks` (PairWise accuracy per task), `same`, `diff`, `pairwise_avg`, `rank` /
    `rank_exact` (per BestOfN subtype 2/3/4), `rank_avg`, `rank_exact_avg`, `length` (PairWise accuracy per length
    bucket), `average` (over all records), `auc`, `auc_source`, `auc_pairs`, `counts`, `unparseable`, `truncated`,
    `bounded_verdict_probs`.

    With `protocol="default"` a group without records is None and a record scores `score_ranking`. With
    `protocol="longrm"` the numbers are those of LongRM's evaluator: a record scores `score_ranking_longrm` (partial
    rankings count), a group without records is 0, Diff is every PairWise record whose subtype is not `same`, the
    length buckets are always 4k..128k, and the rank average is the sum over subtypes 2, 3 and 4 divided by the
    number of all BestOfN records.

    Example:
    ```python
    >>> p = {"task": "Math", "tasktype": "PairWise", "subtype": "same", "length": "4k", "order": [1, 0],
    ...      "predicted_ranks": [1, 0], "truncated": False}
    >>> compute_metrics([p], ["Math"])["pairwise_avg"]
    1.0
    ```
    """
    longrm = protocol == "longrm"
    score = score_ranking_longrm if longrm else score_ranking

    def mean(values: list[float]) -> float | None:
        # LongRM reports an empty group as 0; we report None (0 would read as a failed model).
        return (sum(values) / len(values) if values else 0.0) if longrm else _mean(values)

    scored = []
    for prediction in predictions:
        ratio, exact = score(prediction["order"], prediction.get("predicted_ranks"))
        scored.append((prediction, ratio, exact))
    pairwise = [(p, r) for p, r, _ in scored if p["tasktype"] == "PairWise"]
    bestofn = [(p, r, e) for p, r, e in scored if p["tasktype"] == "BestOfN"]
    if longrm:
        lengths = list(LENGTH_BUCKETS)
        in_diff = [p["subtype"] != "same" for p, _ in pairwise]
        rank_avg = sum(r for p, r, _ in bestofn if p["subtype"] in RANK_SUBTYPES) / len(bestofn) if bestofn else 0.0
    else:
        lengths = _ordered_lengths(p["length"] for p, _ in pairwise if p["length"] is not None)
        in_diff = [p["subtype"] not in ("same", None) for p, _ in pairwise]
        rank_avg = _mean([r for _, r, _ in bestofn])
    diff = [pr for pr, keep in zip(pairwise, in_diff) if keep]

    results: dict = {
        "tasks": {task: mean([r for p, r in pairwise if p["task"] == task]) for task in tasks},
        "same": mean([r for p, r in pairwise if p["subtype"] == "same"]),
        "diff": mean([r for _, r in diff]),
        "pairwise_avg": mean([r for _, r in pairwise]),
        "rank": {s: mean([r for p, r, _ in bestofn if p["subtype"] == s]) for s in RANK_SUBTYPES},
        "rank_exact": {s: mean([float(e) for p, _, e in bestofn if p["subtype"] == s]) for s in RANK_SUBTYPES},
        "rank_avg": rank_avg,
        "rank_exact_avg": mean([float(e) for _, _, e in bestofn]),
        "length": {length: mean([r for p, r in pairwise if p["length"] == length]) for length in lengths},
        "average": mean([r for _, r, _ in scored]),
    }
    if not longrm:
        # Subtypes beyond 2/3/4 get their own rows (LongRM's table has none).
        for subtype in sorted({p["subtype"] for p, _, _ in bestofn} - set(RANK_SUBTYPES)):
            results["rank"][subtype] = mean([r for p, r, _ in bestofn if p["subtype"] == subtype])
            results["rank_exact"][subtype] = mean([float(e) for p, _, e in bestofn if p["subtype"] == subtype])
    auc, source, pairs = compute_auc(predictions)
    results.update(auc=auc, auc_source=source, auc_pairs=pairs, protocol=protocol)
    results["counts"] = {
        "records": len(scored),
        "pairwise": len(pairwise),
        "bestofn": len(bestofn),
        "same": sum(1 for p, _ in pairwise if p["subtype"] == "same"),
        "diff": len(diff),
        "tasks": {task: sum(1 for p, _ in pairwise if p["task"] == task) for task in tasks},
        "length": {length: sum(1 for p, _ in pairwise if p["length"] == length) for length in results["length"]},
        "rank": {s: sum(1 for p, _, _ in bestofn if p["subtype"] == s) for s in results["rank"]},
    }
    results["unparseable"] = {
        "total": sum(1 for p in predictions if not p.get("predicted_ranks")),
        "PairWise": sum(1 for p, _ in pairwise if not p.get("predicted_ranks")),
        "BestOfN": sum(1 for p, _, _ in bestofn if not p.get("predicted_ranks")),
    }
    results["truncated"] = sum(1 for p in predictions if p.get("truncated"))
    # Verdict probabilities that are upper bounds, not exact (a server that reports only its top-k log-probabilities
    # left a verdict token out: `GenerativeJudge._verdict_probs`); 0 with transformers, vLLM and vLLM's server.
    results["bounded_verdict_probs"] = sum(p.get("bounded_verdict_probs", 0) for p in predictions)
    return results


def is_missing(value) -> bool:
    """True for a metric with no records behind it (None or NaN)."""
    return value is None or (isinstance(value, float) and math.isnan(value))
