"""A trained DisRM as a reward function for TRL's online trainers (GRPO, RLOO), each prompt encoded once."""

from __future__ import annotations

from typing import Any

import torch


class LongRMReward:
    """A discriminative reward model as a `reward_funcs` entry of TRL's `GRPOTrainer` / `RLOOTrainer`.

    TRL's own reward-model path (`reward_funcs="path"`) pads every prompt + completion to the longest and encodes the
    prompt once per completion: 8 generations of a 16K-token prompt cost 8 x 16K tokens of attention and activations.
    Here the completions of one prompt share one packed row (the prompt once, each completion attending to it and to
    itself: `trl_longrm.evaluation.judges.plan_shared_rows`), rows filled up to `max_tokens_per_forward` tokens. The
    sequences and the scored token are the stock path's (each conversation rendered by the chat template as
    `GRPOTrainer` renders it, or prompt + completion text; the score read at the last token), so the rewards are
    stock's (`tests/test_reward_function.py`, within 1e-4).

    In each accelerate process the function scores that process's own prompts and completions, on `device` (default:
    the process's accelerator device, where the policy is; pass another to keep the reward model off the policy's
    GPU).

    Example:
    ```python
    >>> from trl import GRPOConfig, GRPOTrainer
    >>> from trl_longrm import LongRMReward
    >>> trainer = GRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=LongRMReward("path/to/disrm"),
    ...                       args=GRPOConfig(output_dir="grpo"), train_dataset=prompts)
    ```
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "auto",
        max_tokens_per_forward: int | None = 65536,
        chat_template_kwargs: dict[str, Any] | None = None,
        name: str = "LongRMReward",
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from trl_longrm.evaluation.judges import DiscriminativeJudge

        if isinstance(model, str):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=dtype)
            if device is None:
                from accelerate import PartialState

                device = PartialState().device
        if tokenizer is None:
            raise ValueError("LongRMReward needs the reward model's tokenizer when the model is given as an instance.")
        if device is not None:
            model = model.to(device)
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        # Every record of a call may share a row; the token budget bounds what one forward holds.
        self.judge = DiscriminativeJudge(
            model, tokenizer, batch_size=1 << 30, shared_prefix=True, max_tokens_per_row=max_tokens_per_forward
        )
        self.__name__ = name  # TRL logs each reward function under its `__name__`

    def sequences(self, prompts: list, completions: list) -> list[list[int]]:
        """The token ids TRL's reward-model path scores for each (prompt, completion)."""
        from trl.data_utils import apply_chat_template, is_conversational

        if is_conversational({"prompt": prompts[0]}):
            texts = [
                apply_chat_template({"messages": p + c}, self.tokenizer, **self.chat_template_kwargs)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        return self.tokenizer(text=texts, add_special_tokens=False)["input_ids"]

    def __call__(self, prompts: list, completions: list, completion_ids=None, **kwargs) -> list[float]:
        """One reward per completion, in order (TRL's reward-function signature)."""
        if not prompts:
            return []
        sequences = self.sequences(prompts, completions)
        # The completions of one prompt, in the order GRPO lays them out (each prompt's generations consecutive; equal
        # prompts elsewhere in the batch are grouped too).
        groups: dict[str, list[int]] = {}
        for index, prompt in enumerate(prompts):
            groups.setdefault(repr(prompt), []).append(index)
        order = [index for members in groups.values() for index in members]
        records = [[sequences[i] for i in members] for members in groups.values()]
        scores = self.judge.score_sequences(records)
        rewards = [0.0] * len(prompts)
        for index, score in zip(order, scores):
            rewards[index] = float(score)
        return rewards
