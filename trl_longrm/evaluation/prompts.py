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


def label(position: int) -> str:
    """Letter naming the response at a display position (0 -> `A`)."""
    return chr(ord("A") + position)


PAIRWISE_SYSTEM_PROMPT = (
    "You are a careful, impartial judge of AI responses. You will see a task, which may include a long document, and "
    "two candidate responses labelled A and B. Decide which response completes the task better: check it against the "
    "document and the instructions for correctness, faithfulness, helpfulness and safety. The order in which the "
    "responses appear, their length and their style must not sway you. Give a brief justification, then end with "
    "your verdict on its own line: [[A]] if response A is better, or [[B]] if response B is better."
)

RANKING_SYSTEM_PROMPT = (
    "You are a careful, impartial judge of AI responses. You will see a task, which may include a long document, and "
    "{n} candidate responses labelled {labels}. Rank all of them from best to worst: check each against the document "
    "and the instructions for correctness, faithfulness, helpfulness and safety. The order in which the responses "
    "appear, their length and their style must not sway you. Give a brief justification, then end with the ranking "
    "on its own line, best first, every label exactly once, in the form {example}."
)


def build_judge_messages(task_prompt: str, responses: list[str], ranking: bool = False) -> list[dict[str, str]]:
    """System and user messages asking a judge to pick the better of two responses, or (`ranking=True`) to rank them.

    BestOfN records always use the ranking protocol, even with two candidates (as LongRM does).

    Example:
    ```python
    >>> messages = build_judge_messages("What is 2+2?", ["4", "5"])
    >>> [m["role"] for m in messages]
    ['system', 'user']
    ```
    """
    n = len(responses)
    if n < 2:
        raise ValueError(f"A judge needs at least 2 responses, got {n}.")
    labels = [label(i) for i in range(n)]
    if not ranking and n != 2:
        raise ValueError(f"A pairwise judgment needs exactly 2 responses, got {n}.")
    if not ranking:
        system = PAIRWISE_SYSTEM_PROMPT
    else:
        example = "[[" + ">".join(labels[::-1]) + "]]"
        system = RANKING_SYSTEM_PROMPT.format(n=n, labels=", ".join(labels), example=example)
    parts = [f"# Task\n{task_prompt}"]
    for letter, response in zip(labels, responses):
        parts.append(f"# Response {letter}\n{response}\n# End of Response {letter}")
    instruction = (
        "Which response is better? End with [[A]] or [[B]]." if not ranking else "Rank the responses, best first."
    )
    parts.append(instruction)
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


POINTWISE_SYSTEM_PROMPT = (
    "You are a careful, impartial judge of AI responses. You will see a task, which may include a long document, and "
    "one candidate response. Rate how well the response completes the task: check it against the document and the "
    "instructions for correctness, faithfulness, helpfulness and safety. Its length and its style must not sway you. "
    "Give a brief justification, then end with your score on its own line, an integer from {low} (worst) to {high} "
    "(best), in the form [[{example}]]."
)
# The score scale of the pointwise protocol: single digits, so that each score is one token for common tokenizers
# (Qwen and Llama 3 split numbers into digits) and the score distribution is read at one position.
POINTWISE_SCALE = (0, 9)


def build_pointwise_messages(task_prompt: str, response: str) -> list[dict[str, str]]:
    """System and user messages asking a judge to score a single response (the pointwise protocol).

    Example:
    ```python
    >>> messages = build_pointwise_messages("What is 2+2?", "4")
    >>> messages[1]["content"].splitlines()[-1]
    'Rate the response from 0 to 9. End with your score, e.g. [[7]].'
    ```
    """
    low, high = POINTWISE_SCALE
    system = POINTWISE_SYSTEM_PROMPT.format(low=low, high=high, example=high - 2)
    parts = [
        f"# Task\n{task_prompt}",
        f"# Response\n{response}\n# End of Response",
        f"Rate the response from {low} to {high}. End with your score, e.g. [[{high - 2}]].",
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


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


_SCORE_VERDICT = re.compile(r"\[\[\s*(\d+)\s*\]\]")


def parse_pointwise_score(text: str) -> int | None:
    """The score of a pointwise judgment (the last `[[N]]` in the text), or None when it has none or N is off the scale.

    Example:
    ```python
    >>> parse_pointwise_score("Quotes the document faithfully. [[8]]"), parse_pointwise_score("[[12]]")
    (8, None)
    ```
    """
    matches = _SCORE_VERDICT.findall(text)
    if not matches:
        return None
    score = int(matches[-1])
    low, high = POINTWISE_SCALE
    return score if low <= score <= high else None


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
