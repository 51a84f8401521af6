"""Middle truncation of an over-long prompt: keep the head and the tail of its longest message.

This is what LongRM's evaluator does for 128K contexts: the question and the response to judge sit at the ends of
the user message, the bulk of the context in the middle. Because decoding and re-encoding the cut text can shift the
token count at the seam (and the chat template adds its own tokens), the cut is re-measured and deepened until the
whole prompt fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase


Prompt = str | list[dict[str, Any]]
MAX_ITERATIONS = 16
# Tokens kept beyond `max_tokens` on each side of a cut by characters: the tokens near the cut may tokenise
# differently from the whole text; these spare ones keep every token truncation can keep far from it.
PRECUT_MARGIN_TOKENS = 64


def cut_middle(text: str, tokenizer: PreTrainedTokenizerBase, keep_tokens: int, encoding=None) -> str:
    """`text` with its middle removed so that about `keep_tokens` tokens remain: the first half and the last half.

    With a fast tokenizer the cut follows the tokens' character offsets, so the kept head and tail are the original
    characters (no decode artefacts); otherwise the kept token ids are decoded.

    Example:
    ```python
    >>> cut_middle("one two three four five six", tokenizer, keep_tokens=2)  # e.g. 'one six'
    ```
    """
    if encoding is None:
        encoding = _encode(text, tokenizer)
    ids = encoding["input_ids"]
    if keep_tokens >= len(ids):
        return text
    head, tail = keep_tokens - keep_tokens // 2, keep_tokens // 2
    offsets = encoding.get("offset_mapping")
    if offsets is not None:
        head_end = offsets[head - 1][1] if head > 0 else 0
        tail_start = offsets[len(ids) - tail][0] if tail > 0 else len(text)
        return text[:head_end] + text[max(tail_start, head_end) :]
    tail_ids = ids[len(ids) - tail :] if tail > 0 else []
    return tokenizer.decode(ids[:head]) + tokenizer.decode(tail_ids)


def _encode(text: str, tokenizer: PreTrainedTokenizerBase) -> dict:
    # verbose=False: no warning about the length of a text that is being cut to fit
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast, verbose=False)


def _longest_message(prompt: Prompt, protected_roles: Sequence[str]) -> int | None:
    # Characters, not tokens, pick the message: tokenising every message of a 128K prompt would double the cost.
    candidates = [i for i, message in enumerate(prompt) if message["role"] not in protected_roles]
    return max(candidates, key=lambda i: len(prompt[i]["content"])) if candidates else None


def _chars_holding(text: str, tokenizer: PreTrainedTokenizerBase, num_tokens: int, from_end: bool) -> int | None:
    """Fewest characters (doubling from 4 per token) at the start (or end) of `text` that hold `num_tokens` tokens,
    or None where half of `text` does not."""
    size = 4 * num_tokens
    while 2 * size < len(text):
        piece = text[-size:] if from_end else text[:size]
        if len(tokenizer(piece, add_special_tokens=False, verbose=False)["input_ids"]) >= num_tokens:
            return size
        size *= 2
    return None


def precut_middle(
    prompt: Prompt,
    tokenizer: PreTrainedTokenizerBase,
    max_tokens: int,
    protected_roles: Sequence[str] = ("assistant",),
) -> Prompt:
    """`prompt` with the middle of the message [`truncate_middle_to_fit`] would cut removed by characters, keeping on
    each side more than `max_tokens` tokens (plus a margin), so that a row of any size costs time and memory bounded
    by `max_tokens` before it is tokenised. The prompt is returned as it is where it is not that long.

    Truncating the result by tokens gives what truncating `prompt` gives: both keep at most `max_tokens` tokens of
    the same head and tail, the counts of the rest of the prompt are the same, and the message keeps being the
    longest (a second very long message stops the cut there). That holds for tokenizers whose tokens far from a cut
    do not depend on it (BPE, WordPiece, Unigram on text with spaces or punctuation; tested).

    Example:
    ```python
    >>> short = precut_middle(messages, tokenizer, max_tokens=2048)  # a 50 MB user message -> about 2 x 8K characters
    ```
    """
    if isinstance(prompt, str):
        target, text, others = None, prompt, 0
    else:
        target = _longest_message(prompt, protected_roles)
        if target is None:
            return prompt
        text = prompt[target]["content"]
        others = max((len(m["content"]) for i, m in enumerate(prompt) if i != target), default=0)
    need = max_tokens + PRECUT_MARGIN_TOKENS
    head = _chars_holding(text, tokenizer, need, from_end=False)
    tail = _chars_holding(text, tokenizer, need, from_end=True) if head is not None else None
    if tail is None or head + tail >= len(text) or head + tail <= others:
        return prompt
    cut = text[:head] + text[len(text) - tail :]
    if target is None:
        return cut
    prompt = [dict(message) for message in prompt]
    prompt[target]["content"] = cut
    return prompt


def truncate_middle_to_fit(
    prompt: Prompt,
    tokenizer: PreTrainedTokenizerBase,
    count_tokens: Callable[[Prompt], int],
    max_tokens: int,
    protected_roles: Sequence[str] = ("assistant",),
    num_tokens: int | None = None,
) -> Prompt | None:
    """Cut the middle of the longest message of `prompt` (or of the string itself) until `count_tokens` fits.

    `count_tokens(prompt)` measures what must fit in `max_tokens` (e.g. the rendered prompt, or the whole rendered
    conversation); pass `num_tokens` when `count_tokens(prompt)` is already known, to save a tokenisation. The longest
    message is the one with the most characters; messages whose role is in `protected_roles` are never cut (their
    tokens are training targets). Returns the truncated prompt (a new object; the input is not modified), the prompt itself if it already fits, or
    None if it cannot fit without emptying that message.

    Example:
    ```python
    >>> count = lambda p: len(tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"])
    >>> short = truncate_middle_to_fit(messages, tokenizer, count, max_tokens=2048)
    ```
    """
    total = count_tokens(prompt) if num_tokens is None else num_tokens
    if total <= max_tokens:
        return prompt

    if isinstance(prompt, str):
        target, text = None, prompt
    else:
        target = _longest_message(prompt, protected_roles)
        if target is None:
            return None
        text = prompt[target]["content"]

    encoding = _encode(text, tokenizer)
    remove = total - max_tokens
    for _ in range(MAX_ITERATIONS):
        keep = len(encoding["input_ids"]) - remove
        if keep <= 0:
            return None
        # Always cut from the original text, deeper each time, so that seam artefacts do not accumulate.
        cut = cut_middle(text, tokenizer, keep, encoding)
        if target is None:
            candidate = cut
        else:
            candidate = [dict(message) for message in prompt]
            candidate[target]["content"] = cut
        total = count_tokens(candidate)
        if total <= max_tokens:
            return candidate
        remove += total - max_tokens
    return None
