"""Consistency majority voting (LongRM section 4.3): several judges' pointwise scores of one response become a
consensus, the judgment of the consensus becomes the chosen one and the other judgments the rejected ones.

The default rules are the ones LongRM's released sample follows on every one of its 20 rows (`LONGRM_RULES`, checked
by `tests/test_datagen_vote.py` against `../shared/data/longrm_simpo_sample`):
- `conf` is the counts of the judges' scores (an unparsable judgment's -1 counted as a score), largest first;
- the consensus is the largest cluster of agreeing scores (equal scores; `tolerance` widens it), a -1 never in it,
  and it needs `min_agreement` judges (2): otherwise the response is dropped, as is a tie of two largest clusters;
- the chosen judgment is that of the first judge of `judge_priority` inside the consensus;
- the rejected ones are all the others, those that disagree with the consensus first, each part in `reject_order`.

Example:
```python
>>> from trl_longrm.datagen.consensus import LONGRM_RULES, vote_scores
>>> scores = {"Llama-3.1-Nemotron-70B-Instruct-HF": 4, "Llama-3.3-70B-Instruct": 2, "MDCure-LLAMA3.1-70B-Instruct": -1,
...           "Qwen-plus": 4, "Qwen2.5-72B-Instruct": 4}
>>> verdict = vote_scores(scores, LONGRM_RULES)
>>> verdict.chosen, verdict.conf, verdict.rejected[:2]
('Qwen2.5-72B-Instruct', [3, 1, 1], ['MDCure-LLAMA3.1-70B-Instruct', 'Llama-3.3-70B-Instruct'])
```
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


UNPARSABLE = -1
"""The score of a judgment without a readable `[Score: N]` (as in LongRM's released data)."""

# The five judges of LongRM's released data, by the names its rows carry.
LONGRM_JUDGES = (
    "Llama-3.3-70B-Instruct",
    "Qwen2.5-72B-Instruct",
    "Llama-3.1-Nemotron-70B-Instruct-HF",
    "Qwen-plus",
    "MDCure-LLAMA3.1-70B-Instruct",
)

# Why a response gives no training row: the reasons `vote` counts.
DROP_NO_CONSENSUS = "no_consensus"
DROP_TIED = "tied_consensus"
DROP_NO_VALID = "no_parsable_score"
# A response with a consensus but nothing to reject (every other judgment agrees, under `rejected="disagreeing"`, or
# writes the chosen one's very text) gives an SFT row and no preference row (the `vote` step counts it).
DROP_NO_REJECTED = "no_rejected_judgment"
DROP_REASONS = (DROP_NO_CONSENSUS, DROP_TIED, DROP_NO_VALID, DROP_NO_REJECTED)


@dataclass(frozen=True)
class VoteRules:
    """How judges' scores become a consensus (see the module's docstring; `LONGRM_RULES` are the released ones).

    Example:
    ```python
    >>> rules = VoteRules(judge_priority=["big-judge", "small-judge", "other"], min_agreement=2, tolerance=1)
    ```
    """

    judge_priority: tuple[str, ...] = field(
        metadata={"help": "Judges in the order their judgment is preferred as the chosen one inside the consensus."}
    )
    reject_order: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "Order of the rejected judgments inside each part (disagreeing, then agreeing). Default None: "
            "`judge_priority`."
        },
    )
    min_agreement: int = field(
        default=2, metadata={"help": "Fewest judges in the consensus; fewer and the response is dropped. Default 2."}
    )
    tolerance: int = field(
        default=0,
        metadata={
            "help": "Two scores agree when they differ by at most this much (a cluster is the scores within it of one "
            "judge's score). Default 0: equal scores."
        },
    )
    on_tie: str = field(
        default="drop",
        metadata={
            "help": "Two largest clusters of one size: 'drop' the response (no consensus), or 'priority': the cluster "
            "of the judge first in `judge_priority`. Default 'drop' (LongRM's sample has no such row).",
            "choices": ["drop", "priority"],
        },
    )
    disagreeing_first: bool = field(
        default=True,
        metadata={"help": "List the rejected judgments that disagree with the consensus first. Default True."},
    )
    rejected: str = field(
        default="all",
        metadata={
            "help": "Which judgments are rejected: 'all' the others (LongRM), or 'disagreeing' only (rows whose every "
            "other judgment agrees are then dropped). Default 'all'.",
            "choices": ["all", "disagreeing"],
        },
    )

    def __post_init__(self):
        object.__setattr__(self, "judge_priority", tuple(self.judge_priority))
        if len(set(self.judge_priority)) != len(self.judge_priority):
            raise ValueError(f"`judge_priority` names a judge twice: {list(self.judge_priority)}.")
        if self.reject_order is not None:
            object.__setattr__(self, "reject_order", tuple(self.reject_order))
            if sorted(self.reject_order) != sorted(self.judge_priority):
                raise ValueError(
                    f"`reject_order` {list(self.reject_order)} must name the judges of `judge_priority` "
                    f"{list(self.judge_priority)}, each once."
                )
        if self.min_agreement < 1:
            raise ValueError(f"`min_agreement` must be >= 1, got {self.min_agreement}.")
        if self.tolerance < 0:
            raise ValueError(f"`tolerance` must be >= 0, got {self.tolerance}.")
        if self.on_tie not in ("drop", "priority"):
            raise ValueError(f"`on_tie` must be 'drop' or 'priority', got {self.on_tie!r}.")
        if self.rejected not in ("all", "disagreeing"):
            raise ValueError(f"`rejected` must be 'all' or 'disagreeing', got {self.rejected!r}.")

    @property
    def rejection_order(self) -> tuple[str, ...]:
        return self.reject_order or self.judge_priority


# The rules of LongRM's released data: the chosen judgment from Llama-3.3-70B, else Qwen2.5-72B (no row of the sample
# needs a third), the rejected ones in the order Nemotron-70B, Qwen-plus, MDCure-70B, then Llama-3.3-70B / Qwen2.5-72B.
LONGRM_RULES = VoteRules(
    judge_priority=LONGRM_JUDGES,
    reject_order=(
        "Llama-3.1-Nemotron-70B-Instruct-HF",
        "Qwen-plus",
        "MDCure-LLAMA3.1-70B-Instruct",
        "Llama-3.3-70B-Instruct",
        "Qwen2.5-72B-Instruct",
    ),
)


@dataclass(frozen=True)
class Verdict:
    """The vote on one response: `chosen` judge, `rejected` judges in order (empty where there is nothing to reject:
    an SFT row and no preference row), the `consensus` score (the chosen judgment's), the judges in the consensus
    (`agreeing`), and `conf` (score counts, largest first). `dropped` names why there is no consensus and so no
    training row (then `chosen` is None)."""

    conf: list[int]
    consensus: int | None = None
    chosen: str | None = None
    rejected: list[str] = field(default_factory=list)
    agreeing: list[str] = field(default_factory=list)
    dropped: str | None = None


def score_counts(scores: Sequence[int]) -> list[int]:
    """`conf`: how many judges gave each score, largest first (an unparsable -1 counts as a score)."""
    return sorted(Counter(scores).values(), reverse=True)


def vote_scores(scores: Mapping[str, int], rules: VoteRules) -> Verdict:
    """The vote on one response from each judge's score (`UNPARSABLE` for a judgment without a score).

    `scores` must hold a score for every judge of `rules` and no other (a `ValueError` names the difference)."""
    judges = set(rules.judge_priority)
    if set(scores) != judges:
        missing, extra = sorted(judges - set(scores)), sorted(set(scores) - judges)
        raise ValueError(f"scores for the judges {sorted(judges)} expected; missing {missing}, unknown {extra}.")
    conf = score_counts([int(scores[judge]) for judge in rules.judge_priority])
    rank = {judge: i for i, judge in enumerate(rules.judge_priority)}
    valid = {judge: int(score) for judge, score in scores.items() if int(score) != UNPARSABLE}
    if not valid:
        return Verdict(conf=conf, dropped=DROP_NO_VALID)
    # One candidate cluster around each score given: the judges whose scores lie within `tolerance` of it.
    clusters = {}
    for center in sorted(set(valid.values())):
        members = [judge for judge, score in valid.items() if abs(score - center) <= rules.tolerance]
        clusters[center] = sorted(members, key=rank.__getitem__)
    size = max(len(members) for members in clusters.values())
    largest = {center: members for center, members in clusters.items() if len(members) == size}
    if size < rules.min_agreement:
        return Verdict(conf=conf, dropped=DROP_NO_CONSENSUS)
    if len(largest) > 1 and rules.on_tie == "drop":
        # Overlapping clusters of one size (with a tolerance) around the same judges are one consensus.
        if len({tuple(members) for members in largest.values()}) > 1:
            return Verdict(conf=conf, dropped=DROP_TIED)
    # The cluster of the judge first in priority (ties by `on_tie="priority"`, or overlapping equal clusters).
    _, agreeing = min(largest.items(), key=lambda item: rank[item[1][0]])
    chosen = agreeing[0]
    consensus = valid[chosen]  # the score the chosen judgment writes
    order = {judge: i for i, judge in enumerate(rules.rejection_order)}
    others = sorted((judge for judge in rules.judge_priority if judge != chosen), key=order.__getitem__)
    disagreeing = [judge for judge in others if judge not in agreeing]
    agreeing_others = [judge for judge in others if judge in agreeing]
    if rules.rejected == "disagreeing":
        rejected = disagreeing
    elif rules.disagreeing_first:
        rejected = disagreeing + agreeing_others
    else:
        rejected = others
    return Verdict(conf=conf, consensus=consensus, chosen=chosen, rejected=rejected, agreeing=agreeing)
