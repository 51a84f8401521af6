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
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)


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
        candidates = [i for i, message in enumerate(prompt) if message["role"] not in protected_roles]
        if not candidates:
            return None
        # Characters, not tokens, pick the message: tokenising every message of a 128K prompt would double the cost.
        target = max(candidates, key=lambda i: len(prompt[i]["content"]))
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
