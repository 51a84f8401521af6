"""Where a discriminative reward model's score is read, in one place.

The ecosystem's convention, which every trainer, evaluator and scorer of this package follows: the score of a
sequence is the score head at its **last token**, the sequence being the conversation as the chat template renders it
(`trl_longrm.data.scoring_ids`; ChatML's newline after `<|im_end|>` included), or a plain prompt and response ending
with an EOS. That is the token transformers' sequence classification pools (the last token that is not the pad
token), RewardTrainer trains and, for a conversation, TRL's GRPO/RLOO read from a reward model, given one condition
this module ensures on the checkpoints we train: **the pad token is not the EOS token**. With pad == EOS, stock pooling
skips a sequence's final EOS as if it were padding and reads the token before it.

Plain-text rows are the exception, inherited from TRL: GRPO/RLOO score the text prompt + completion, tokenized as one
without special tokens, and the completion is the policy's output decoded without its EOS. They read the last token of
the completion, the token before the EOS that training scored (and without the BOS that training's prompt gets from a
tokenizer adding one). `trl_longrm.LongRMReward` reads GRPO's token by default, so that its rewards are stock's, and
the trained one with `as_trained=True`.

Example:
```python
>>> ensure_distinct_pad_token(tokenizer, model)  # before training or saving a DisRM
'<|finetune_right_pad_id|>'
>>> model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
True
```
"""

from __future__ import annotations

import logging
import re


logger = logging.getLogger(__name__)

NEW_PAD_TOKEN = "<|pad|>"
"""The pad token added to a vocabulary that has no unused special token to serve as one."""

# Special tokens that are by convention never written by a chat template or a user: preferred as pad, in this order.
_PAD_NAME_PATTERNS = (r"pad", r"end_?of_?text", r"reserved|unused")


def score_index(length: int) -> int:
    """Index of the scored token in a sequence of `length` tokens: its last."""
    return length - 1


def unused_special_token(tokenizer) -> str | None:
    """An existing special token that can serve as a pad distinct from EOS: not the EOS, BOS or UNK token, not written
    by the chat template, and named like a pad, an end-of-text or a reserved/unused token (in that order of
    preference; the lowest id among equals). None when the vocabulary has none."""
    reserved = {tokenizer.eos_token, tokenizer.bos_token, tokenizer.unk_token} - {None}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    added = sorted(
        (index, token.content)
        for index, token in tokenizer.added_tokens_decoder.items()
        if token.special and token.content not in reserved and token.content not in template
    )
    for pattern in _PAD_NAME_PATTERNS:
        for _, content in added:
            if re.search(pattern, content, flags=re.IGNORECASE):
                return content
    return None


def ensure_distinct_pad_token(tokenizer, model, user_pad_token: str | None = None) -> str | None:
    """Make the tokenizer's pad token, and `model.config.pad_token_id`, differ from EOS, so that stock pooling reads a
    sequence's last token (see the module's docstring). Returns the pad token set, None when nothing changed.

    The pad becomes an unused existing special token (`unused_special_token`), else `NEW_PAD_TOKEN`, added to the
    vocabulary with the model's embeddings resized (not possible under a PEFT adapter, which would not save the new
    row: an error asks for a `pad_token`). A `user_pad_token` equal to EOS is refused rather than changed.
    """
    eos = tokenizer.eos_token
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if tokenizer.pad_token is not None and tokenizer.pad_token != eos:
        text_config.pad_token_id = tokenizer.pad_token_id
        return None
    if user_pad_token is not None and user_pad_token == eos:
        raise ValueError(
            f"pad_token={user_pad_token!r} is the EOS token. A reward model's score is read at each sequence's last "
            "token, and with pad == EOS transformers' sequence classification (and TRL's GRPO/RLOO) would skip a "
            "final EOS as padding and read the token before it. Set `pad_token` to another token, or leave it unset "
            "to let the trainer choose an unused special token."
        )
    token = unused_special_token(tokenizer)
    if token is None:
        if hasattr(model, "peft_config"):
            raise ValueError(
                f"The tokenizer's pad token is its EOS token ({eos!r}) and its vocabulary has no unused special token "
                f"to pad with instead; adding {NEW_PAD_TOKEN!r} would resize the embeddings, which a PEFT adapter "
                "does not save. Add a pad token to the tokenizer and the model before training, or set `pad_token`."
            )
        tokenizer.add_special_tokens({"pad_token": NEW_PAD_TOKEN})
        model.resize_token_embeddings(len(tokenizer))
        token = NEW_PAD_TOKEN
    else:
        tokenizer.pad_token = token
    text_config.pad_token_id = tokenizer.pad_token_id
    logger.warning(
        "The pad token was the EOS token %r; it is now %r (id %d) in the tokenizer and the model's config, so that "
        "the saved reward model is scored at each sequence's last token by transformers' pooling and TRL's "
        "GRPO/RLOO, as it is trained.",
        eos,
        token,
        tokenizer.pad_token_id,
    )
    return token
