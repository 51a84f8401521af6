"""A trained DisRM as a reward function for TRL's online trainers (GRPO, RLOO), each prompt encoded once."""

from __future__ import annotations

from typing import Any

import torch


def _trainer_chat_template_kwargs(reward_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `chat_template_kwargs` of the GRPO/RLOO trainer calling a reward function, `{}` outside a trainer.

    Stock GRPO/RLOO render a reward model's conversations with their `args.chat_template_kwargs`, but pass a reward
    function neither the trainer nor its arguments; they do pass bound methods of the trainer (`log_metric`,
    `log_extra`), whose owner holds the kwargs as stock reads them (`self.chat_template_kwargs`)."""
    for key in ("log_metric", "log_extra"):
        trainer = getattr(reward_kwargs.get(key), "__self__", None)
        if trainer is not None and hasattr(trainer, "chat_template_kwargs"):
            return dict(trainer.chat_template_kwargs or {})
    return {}


class LongRMReward:
    """A discriminative reward model as a `reward_funcs` entry of TRL's `GRPOTrainer` / `RLOOTrainer`.

    TRL's own reward-model path (`reward_funcs="path"`) pads every prompt + completion to the longest and encodes the
    prompt once per completion: 8 generations of a 16K-token prompt cost 8 x 16K tokens of attention and activations.
    Here the completions of one prompt share one packed row (the prompt once, each completion attending to it and to
    itself: `trl_longrm.evaluation.judges.plan_shared_rows`), rows filled up to `max_tokens_per_forward` tokens. The
    sequences and the scored token are the stock path's, so the rewards are stock's (`tests/test_reward_function.py`,
    within 1e-4):

    - a conversation is rendered by the reward model's chat template as `GRPOTrainer` renders it: prompt + completion
      messages (tool calls and tool answers included, no `tools` schema), with the calling trainer's
      `chat_template_kwargs` (`GRPOConfig.chat_template_kwargs`) updated with this function's own;
    - a plain-text row is the text prompt + completion, tokenized without special tokens, as stock. This is *not* the
      sequence a DisRM is trained on, nor the one `trl-longrm score` and `trl-longrm eval` read: those tokenize the
      prompt with the tokenizer's special tokens (a BOS) and the response apart, and end it with an EOS, where GRPO's
      completion is decoded without its EOS. The score is then read one token earlier than in training (at the last
      completion token instead of the EOS). `as_trained=True` scores plain-text rows on the trained sequence
      (`trl_longrm.data.scoring_ids`) instead; conversations are the same either way.

    The score is read at each sequence's last token. A row whose sequence has no token (an empty prompt and completion
    with a tokenizer adding no special tokens) has no score to read: it is refused, naming the row (stock GRPO fails
    on it alone and scores it 0.0 beside longer rows).

    In each accelerate process the function scores that process's own prompts and completions, on `device` (default:
    the process's accelerator device, where the policy is and where `GRPOTrainer` places a reward model it is given;
    a model instance is moved there too; pass another device to keep the reward model off the policy's GPU).

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
        as_trained: bool = False,
        name: str = "LongRMReward",
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from trl_longrm.evaluation.judges import DiscriminativeJudge

        if isinstance(model, str):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=dtype)
        if tokenizer is None:
            raise ValueError("LongRMReward needs the reward model's tokenizer when the model is given as an instance.")
        if device is None:
            from accelerate import PartialState

            # Where GRPOTrainer puts a reward model of its own (`accelerator.prepare_model`): the process's device.
            device = PartialState().device
        model = model.to(device)
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.as_trained = as_trained
        # Every record of a call may share a row; the token budget bounds what one forward holds.
        self.judge = DiscriminativeJudge(
            model, tokenizer, batch_size=1 << 30, shared_prefix=True, max_tokens_per_row=max_tokens_per_forward
        )
        self.__name__ = name  # TRL logs each reward function under its `__name__`

    def sequences(
        self, prompts: list, completions: list, chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[list[int]]:
        """The token ids scored for each (prompt, completion): TRL's reward-model path's, conversations rendered with
        `chat_template_kwargs` (default this function's own); with `as_trained`, plain-text rows as training's."""
        from trl.data_utils import apply_chat_template, is_conversational

        if is_conversational({"prompt": prompts[0]}):
            kwargs = self.chat_template_kwargs if chat_template_kwargs is None else chat_template_kwargs
            texts = [
                apply_chat_template({"messages": p + c}, self.tokenizer, **kwargs)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        elif self.as_trained:
            from trl_longrm.data import scoring_ids

            # Each prompt tokenized once for all of its completions.
            rows_of: dict[str, list[int]] = {}
            for index, prompt in enumerate(prompts):
                rows_of.setdefault(prompt, []).append(index)
            sequences: list[list[int]] = [[] for _ in prompts]
            for prompt, rows in rows_of.items():
                for index, ids in zip(rows, scoring_ids(self.tokenizer, prompt, [completions[i] for i in rows])):
                    sequences[index] = ids
            return sequences
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        return self.tokenizer(text=texts, add_special_tokens=False)["input_ids"]

    def __call__(self, prompts: list, completions: list, completion_ids=None, **kwargs) -> list[float]:
        """One reward per completion, in order (TRL's reward-function signature)."""
        if not prompts:
            return []
        template_kwargs = {**_trainer_chat_template_kwargs(kwargs), **self.chat_template_kwargs}
        sequences = self.sequences(prompts, completions, template_kwargs)
        for index, sequence in enumerate(sequences):
            if not sequence:
                raise ValueError(
                    f"{self.__name__}: row {index} (prompt {prompts[index]!r}, completion {completions[index]!r}) has "
                    "no token to score: a reward model's score is read at a sequence's last token. Give the row a "
                    "non-empty prompt."
                )
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
