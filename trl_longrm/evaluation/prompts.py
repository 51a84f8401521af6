"""The generative judging protocols: per-record candidate shuffling, judge prompts and verdict parsing.

A pairwise judge ends its answer with `[[A]]` or `[[B]]`; a ranking judge with an order such as `[[C>A>B]]`. A parsed
verdict is returned as *predicted ranks per displayed position* (0 = best), the representation LongRM scores against
the gold ranks of the shuffled candidates. A pointwise judge sees one response at a time and ends with a score such as
`[[7]]` (0 worst, 9 best); the ranks of a record's responses then follow from their scores.
"""

from __future__ import annotations

import hashlib
import random
import re

from trl_longrm.evaluation.templates import PromptTemplate, label  # noqa: F401 (label: re-exported)


def shuffled_order(seed: int, record_id: str, n: int) -> list[int]:
    """Display order of a record's candidates: `order[p]` is the index (= gold rank) of the candidate shown at p.

    It depends only on `seed` and the record id, through SHA-256, so it is the same in every process and batch.

    Example:
    ```python
    >>> shuffled_order(42, "LongQA/q-1", 3) == shuffled_order(42, "LongQA/q-1", 3)
    True
    ```
    """
    digest = hashlib.sha256(f"{seed}\x00{record_id}".encode()).digest()
    order = list(range(n))
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(order)
    return order


# The built-in prompts, read from `templates/default.yaml` (the shape of a `--prompt-template` file).
DEFAULT_TEMPLATE = PromptTemplate.default()
PAIRWISE_SYSTEM_PROMPT = DEFAULT_TEMPLATE.pairwise.system
RANKING_SYSTEM_PROMPT = DEFAULT_TEMPLATE.ranking.system
POINTWISE_SYSTEM_PROMPT = DEFAULT_TEMPLATE.pointwise.system
# The score scale of the built-in pointwise protocol: single digits, so that each score is one token for common
# tokenizers (Qwen and Llama 3 split numbers into digits) and the score distribution is read at one position.
POINTWISE_SCALE = DEFAULT_TEMPLATE.pointwise_format.scale


def build_judge_messages(task_prompt: str, responses: list[str], ranking: bool = False) -> list[dict[str, str]]:
    """System and user messages (built-in prompts) asking a judge to pick the better of two responses, or
    (`ranking=True`) to rank them.

    BestOfN records always use the ranking protocol, even with two candidates (as LongRM does).

    Example:
    ```python
    >>> messages = build_judge_messages("What is 2+2?", ["4", "5"])
    >>> [m["role"] for m in messages]
    ['system', 'user']
    ```
    """
    if ranking:
        return DEFAULT_TEMPLATE.ranking_messages(task_prompt, responses)
    return DEFAULT_TEMPLATE.pairwise_messages(task_prompt, responses)


def build_pointwise_messages(task_prompt: str, response: str) -> list[dict[str, str]]:
    """System and user messages (built-in prompts) asking a judge to score a single response (the pointwise protocol).

    Example:
    ```python
    >>> messages = build_pointwise_messages("What is 2+2?", "4")
    >>> messages[1]["content"].splitlines()[-1]
    'Rate the response from 0 to 9. End with your score, e.g. [[7]].'
    ```
    """
    return DEFAULT_TEMPLATE.pointwise_messages(task_prompt, response)


_PAIR_VERDICT = re.compile(r"\[\[\s*([AB])\s*\]\]")
_RANK_VERDICT = re.compile(r"\[\[\s*([A-Z](?:\s*>\s*[A-Z])+)\s*\]\]")


def parse_pairwise_verdict(text: str) -> list[int] | None:
    """Predicted ranks of the two displayed responses from a judge's text, or None when unparseable.

    The last `[[A]]`/`[[B]]` wins (a judge may quote the format before its verdict). `[[A]]` -> `[0, 1]`.

    Example:
    ```python
    >>> parse_pairwise_verdict("B misreads the document. [[A]]"), parse_pairwise_verdict("no verdict")
    ([0, 1], None)
    ```
    """
    matches = _PAIR_VERDICT.findall(text)
    if not matches:
        return None
    return [0, 1] if matches[-1] == "A" else [1, 0]


def parse_ranking_verdict(text: str, n: int) -> list[int] | None:
    """Predicted rank of each displayed response from an order like `[[C>A>B]]`, or None when unparseable.

    The last ranking in the text wins; it must name each of the `n` labels exactly once.

    Example:
    ```python
    >>> parse_ranking_verdict("... [[C>A>B]]", 3)  # A is second, B third, C first
    [1, 2, 0]
    ```
    """
    matches = _RANK_VERDICT.findall(text)
    if not matches:
        return None
    letters = [part.strip() for part in matches[-1].split(">")]
    positions = [ord(letter) - ord("A") for letter in letters]
    if sorted(positions) != list(range(n)):
        return None
    return [positions.index(p) for p in range(n)]


def parse_pointwise_score(text: str) -> int | None:
    """The score of a built-in pointwise judgment (the last `[[N]]` in the text), or None when it has none or N is off
    the scale.

    Example:
    ```python
    >>> parse_pointwise_score("Quotes the document faithfully. [[8]]"), parse_pointwise_score("[[12]]")
    (8, None)
    ```
    """
    return DEFAULT_TEMPLATE.pointwise_format.parse(text)


def ranks_from_scores(scores: list[float]) -> list[int]:
    """Predicted rank of each displayed response from per-response scores (higher is better; ties keep display order).

    Example:
    ```python
    >>> ranks_from_scores([0.1, 2.0, -1.0])
    [1, 0, 2]
    ```
    """
    best_first = sorted(range(len(scores)), key=lambda p: -scores[p])
    return [best_first.index(p) for p in range(len(scores))]
