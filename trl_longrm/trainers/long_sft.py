"""Stage I of the generative reward model: supervised fine-tuning of a judge on long-context judging data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import SFTConfig, SFTTrainer

from trl_longrm.heads import add_token_logprob_head
from trl_longrm.packing import SFTCollator
from trl_longrm.sequence_parallel import SequenceParallelConfig
from trl_longrm.trainers.common import LongContextDataArguments, pad_token_id_of, prepare_sft_dataset
from trl_longrm.trainers.parallel import SequenceParallelMixin


@dataclass
class LongSFTConfig(SFTConfig, LongContextDataArguments, SequenceParallelConfig):
    """Configuration of [`LongSFTTrainer`]: TRL's `SFTConfig` plus long-context data fields.

    `max_length` bounds one example (longer ones are truncated in the middle of the prompt's longest message, or
    dropped, per `truncation`, and counted). With `packing=True` examples are binned into rows of
    `max_tokens_per_row` tokens (default: `max_length`), as TRL's BFD packing does.

    Example:
    ```python
    >>> from trl_longrm import LongSFTConfig
    >>> args = LongSFTConfig(output_dir="sft", max_length=131072)
    ```
    """

    max_length: int | None = field(
        default=131072, metadata={"help": "Most tokens of one example. Default 131072 (LongRM)."}
    )
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Lay every sequence of a micro-batch end to end in one row with `position_ids` restarting per "
            "sequence, computing no padding (default True). False gives a padded batch with an attention mask."
        },
    )
    learning_rate: float = field(default=2e-6, metadata={"help": "Initial AdamW learning rate. Default 2e-6."})

    def __post_init__(self):
        super().__post_init__()
        SequenceParallelConfig.__post_init__(self)


class LongSFTTrainer(SequenceParallelMixin, SFTTrainer):
    """SFT on judgment tokens only (assistant turns), for long conversations; a drop-in for TRL's `SFTTrainer`.

    Accepts LongRM's SFT format (`chat_template` + `golden`) and TRL's `messages` / `prompt`+`completion` formats;
    packs padding-free with the same collator layout as the preference trainers, and computes log-probs only at the
    trained tokens.

    Example:
    ```python
    >>> from trl_longrm import LongSFTConfig, LongSFTTrainer
    >>> trainer = LongSFTTrainer(model="Qwen/Qwen3-8B", args=LongSFTConfig(output_dir="sft"), train_dataset=data)
    >>> trainer.train()
    ```
    """

    _tag_names = ["trl", "trl-longrm", "sft"]

    def __init__(self, model, args: LongSFTConfig | None = None, data_collator=None, *pargs, **kwargs):
        if args is None:
            args = LongSFTConfig(output_dir="long-sft")
        # SFTTrainer refuses a custom collator in padding-free mode, and refuses padding-free without its own packing
        # because it would not enforce `max_length`; our dataset preparation enforces it, and our collator replaces
        # its collator after `__init__`. So TRL sees `padding_free=False` while it initialises.
        padding_free, args.padding_free = args.padding_free, False
        try:
            super().__init__(model, args, None, *pargs, **kwargs)
        finally:
            args.padding_free = padding_free
        self.data_collator = data_collator or SFTCollator(
            pad_token_id=pad_token_id_of(self._tokenizer),
            padding_free=args.padding_free,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )
        add_token_logprob_head(self.model, chunk_elements=args.logprob_chunk_elements)
        self._init_long_context(pad_token_id_of(self._tokenizer))

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if formatting_func is not None:
            raise ValueError("LongSFTTrainer does not take a `formatting_func`; pass messages or prompt/completion.")
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        budget = (args.max_tokens_per_row or args.max_length) if packing else args.max_tokens_per_row
        return prepare_sft_dataset(dataset, tokenizer, args, dataset_name, budget)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "completion_mask", "num_tokens"]

    def token_logps(self, model, batch: dict[str, torch.Tensor]):
        """Per-position log-probs of the next token and the mask of trained positions."""
        return self.forward_token_logps(model, batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        token_logps, label_mask = self.token_logps(model, inputs)
        num_tokens = label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = -token_logps.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        # Like TRL: `num_items_in_batch` counts every rank's tokens and DDP averages gradients across ranks.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes

        gather = self.accelerator.gather_for_metrics
        with torch.no_grad():
            if mode == "train":
                self._total_train_tokens += self._count_tokens(inputs)
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            scored = gather(label_mask.sum()).sum()
            nll = gather(-token_logps.detach().sum()).sum() / scored.clamp(min=1)
            self._metrics[mode]["nll"].append(nll.item())
        if return_outputs:
            return loss, {"token_logps": token_logps}
        return loss
