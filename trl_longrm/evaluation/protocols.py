"""The `longrm` evaluation protocol: the original LongRM evaluator's candidate order, parsing and scoring.

Our default protocol (`trl_longrm.evaluation.prompts`, `metrics.score_ranking`) orders each record's candidates by a
hash of (seed, record id), reads the *last* verdict of a judgment and scores only complete rankings. LongRM's own
evaluator does each of these differently, and its published numbers depend on it. `--protocol longrm` reproduces it,
so that a checkpoint's numbers can be compared with the paper's from the same judge outputs:

- order: per task file, Python's `random` seeded with `seed` (42) shuffles the selected records (in file order), then
  draws, record after record in that shuffled order, a permutation of each record's candidates;
- pairwise parsing: the first displayed answer wins if the text contains `[[A]]` anywhere, else the second if it
  contains `[[B]]`;
- ranking parsing: the first bracketed `X>Y>...` group, with partial or longer orders kept as they are;
- scoring: position-wise matches over the positions both orders have, divided by the number of candidates;
- truncation: an input of at least `max_length` tokens keeps its first `max_length // 2` and last
  `max_length - max_length // 2 - 5` tokens (`>=`, where ours cuts only inputs longer than `max_length`).
Metrics (empty groups are 0, the rank average) are in `trl_longrm.evaluation.metrics`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence


def longrm_orders(records: Sequence, seed: int = 42) -> dict[str, list[int]]:
    """Display order of every record of ONE task file, as LongRM's evaluator draws it.

    `records` are the file's records that are evaluated (their tasktype among the selected formats), in file order;
    the result maps each record id to `order` (`order[p]`: index, i.e. gold rank, of the candidate shown at p). The
    order of a record depends on every record of the file before it in the shuffled order, so it must be computed
    over the whole selection, never per batch or per process.

    Example:
    ```python
    >>> orders = longrm_orders(load_benchmark("./LongReward-Bench", ["Math"], ["PairWise", "BestOfN"]))
    ```
    """
    rng = random.Random(seed)
    shuffled = list(records)
    rng.shuffle(shuffled)
    orders = {}
    for record in shuffled:
        order = list(range(len(record.candidates)))
        rng.shuffle(order)
        orders[record.id] = order
    return orders


def parse_pairwise_longrm(text: str) -> list[int] | None:
    """LongRM's pairwise parsing: `[0, 1]` if `[[A]]` occurs anywhere in the text, else `[1, 0]` if `[[B]]` does.

    Example:
    ```python
    >>> parse_pairwise_longrm("[[B]] would be wrong: [[A]]"), parse_pairwise_longrm("A is better")
    ([0, 1], None)
    ```
    """
    if "[[A]]" in text:
        return [0, 1]
    if "[[B]]" in text:
        return [1, 0]
    return None


# `[`, word characters or whitespace, then one or more `>`-separated groups of them, then `]`. It matches `[B>A]`
# and, in `[[B>A]]`, the inner `[B>A]` (a second `[` is not a word character).
_LONGRM_RANKING = re.compile(r"\[[\w\s]+(?:\s*>\s*[\w\s]+)+\]")
_LONGRM_RANKING_NOISE = ("assistant", "Assistant", ":", " ")
_LONGRM_MAX_PIECES = 10


def parse_ranking_longrm(text: str) -> list[int] | None:
    """LongRM's ranking parsing: the predicted rank of each displayed position, possibly partial, or None.

    No ranking when the text split on `>` has more than 10 pieces. Otherwise the first bracketed group
    (`_LONGRM_RANKING`) is split on `>`; `assistant`, `Assistant`, `:` and spaces are removed from every piece, and `[`
    / `]` from the outer ends; each piece must then be one character, mapped to an index (`A` -> 0). The result lists,
    for each i in 0..pieces-1, the position of i among the pieces, so `[C>A>B]` -> `[1, 2, 0]`, three letters for four
    candidates give three ranks, and a missing index (`[A>C]`) or a longer piece gives no ranking.

    Example:
    ```python
    >>> parse_ranking_longrm("[[C>A>B]]"), parse_ranking_longrm("[Assistant B > Assistant A]"), parse_ranking_longrm("[A>C]")
    ([1, 2, 0], [1, 0], None)
    ```
    """
    if len(text.split(">")) > _LONGRM_MAX_PIECES:
        return None
    match = _LONGRM_RANKING.search(text)
    if match is None:
        return None
    pieces = match.group(0).split(">")
    for noise in _LONGRM_RANKING_NOISE:
        pieces = [piece.replace(noise, "") for piece in pieces]
    pieces[0] = pieces[0].strip("[")
    pieces[-1] = pieces[-1].strip("]")
    if any(len(piece) != 1 for piece in pieces):
        return None
    indices = [ord(piece) - ord("A") for piece in pieces]
    if any(i not in indices for i in range(len(indices))):
        return None
    return [indices.index(i) for i in range(len(indices))]


def score_ranking_longrm(order: list[int], predicted_ranks: list[int] | None) -> tuple[float, bool]:
    """LongRM's record score: matches over the positions both orders have, over the number of candidates.

    Returns (score, exact) where `exact` means the whole order was predicted; no ranking scores (0, False).

    Example:
    ```python
    >>> score_ranking_longrm([2, 0, 1, 3], [2, 0, 3])  # a partial ranking of 3 letters for 4 candidates
    (0.5, False)
    ```
    """
    if not predicted_ranks:
        return 0.0, False
    matches = sum(int(g == p) for g, p in zip(order, predicted_ranks))
    return matches / len(order), list(predicted_ranks) == list(order)
