"""Discriminative reward model: Bradley-Terry on a scalar head at each sequence's last token, k rejected."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import RewardConfig, RewardTrainer

from trl_longrm.data.stock_columns import GROUP_COLUMNS, REWARD_COLUMNS
from trl_longrm.heads import add_last_token_score_head
from trl_longrm.losses import bradley_terry_loss, center_rewards_penalty, group_values
from trl_longrm.memory.partial_checkpointing import check_partial_checkpointing_args
from trl_longrm.memory.selective_checkpointing import (
    check_selective_checkpointing_args,
    check_selective_checkpointing_setup,
)
from trl_longrm.packing import PreferenceCollator
from trl_longrm.scoring import ensure_distinct_pad_token
from trl_longrm.sequence_parallel import SequenceParallelConfig
from trl_longrm.trainers.common import (
    SHARED_PREFIX_HELP,
    LongContextDataArguments,
    RejectedCountArguments,
    check_activation_offload_args,
    check_num_rejected,
    check_shared_prefix_args,
    install_activation_offload,
    install_checkpointing_switches,
    keep_heads_under_liger,
    padded_fallback_args,
    prepare_preference_dataset,
    reduce_over_rows,
    stock_activation_offloading_off,
    uses_shared_prefix,
)
from trl_longrm.trainers.parallel import SequenceParallelMixin


@dataclass
class SimPODisRMConfig(RewardConfig, LongContextDataArguments, RejectedCountArguments, SequenceParallelConfig):
    """Configuration of [`SimPODisRMTrainer`]: TRL's `RewardConfig` plus the LongRM loss options and long-context
    data fields (see `LongContextDataArguments`).

    Example:
    ```python
    >>> from trl_longrm import SimPODisRMConfig
    >>> args = SimPODisRMConfig(output_dir="disrm", reject_aggregation="mean", gamma=0.0)
    ```
    """

    gamma: float = field(
        default=0.0,
        metadata={
            "help": "SimPO-style target margin subtracted inside the Bradley-Terry sigmoid: "
            "`-logsigmoid(s_chosen - s_rejected - gamma)`. Default 0.0 (plain Bradley-Terry, as LongRM)."
        },
    )
    reject_aggregation: str = field(
        default="mean",
        metadata={
            "help": "How k rejected scores enter the loss. 'mean' (LongRM, default): one comparison of the chosen "
            "score against the mean rejected score. 'pairwise': the mean of the k pairwise Bradley-Terry losses, "
            "so every rejected response must be beaten on its own. Both equal the stock loss when k == 1.",
            "choices": ["mean", "pairwise"],
        },
    )
    max_length: int | None = field(
        default=131072,
        metadata={"help": "Most tokens of prompt + longest response of a group. Default 131072 (LongRM)."},
    )
    learning_rate: float = field(default=2e-6, metadata={"help": "Initial AdamW learning rate. Default 2e-6."})
    shared_prefix: bool = field(default=True, metadata={"help": SHARED_PREFIX_HELP.format(default="True")})

    def __post_init__(self):
        super().__post_init__()
        SequenceParallelConfig.__post_init__(self)
        check_num_rejected(self)
        check_shared_prefix_args(self)
        check_activation_offload_args(self)
        check_selective_checkpointing_args(self)
        check_partial_checkpointing_args(self)


class SimPODisRMTrainer(SequenceParallelMixin, RewardTrainer):
    """Bradley-Terry trainer for long-context discriminative reward models, a drop-in for TRL's `RewardTrainer`.

    Accepts the formats of `trl_longrm.data` with k >= 1 rejected responses per prompt, packs them padding-free,
    and scores each sequence at its own last token (the stock head pools one token per row, wrong for a packed row).
    No vocabulary logits are ever computed.

    Example:
    ```python
    >>> from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer
    >>> trainer = SimPODisRMTrainer(model="path/to/model", args=SimPODisRMConfig(output_dir="disrm"),
    ...                             train_dataset=dataset)
    >>> trainer.train()
    ```
    """

    _tag_names = ["trl", "trl-longrm", "reward-trainer", "discriminative-reward-model"]

    def __init__(self, model, args: SimPODisRMConfig | None = None, data_collator=None, *pargs, **kwargs):
        if args is None:
            args = SimPODisRMConfig(output_dir="simpo-disrm")
        # A model whose attention the packed padding-free rows cannot use (sliding windows, ...) trains padded.
        args = padded_fallback_args(model, args, type(self).__name__)
        keep_heads_under_liger(args, type(self).__name__)
        check_selective_checkpointing_setup(args, model, kwargs.get("peft_config"))
        self._user_collator = data_collator
        with stock_activation_offloading_off(args):
            super().__init__(model, args, data_collator, *pargs, **kwargs)
        install_activation_offload(self)
        install_checkpointing_switches(self)
        # Saved with a pad token other than EOS, the model is scored by stock consumers where it is trained: at each
        # sequence's last token (`trl_longrm.scoring`).
        ensure_distinct_pad_token(self.processing_class, self.model, args.pad_token)
        if data_collator is None:
            # RewardTrainer built its pair collator; ours handles k rejected responses and packing.
            self.data_collator = PreferenceCollator(
                pad_token_id=self.processing_class.pad_token_id,
                padding_free=args.padding_free,
                pad_to_multiple_of=args.pad_to_multiple_of,
                shared_prefix=uses_shared_prefix(args),
            )
        add_last_token_score_head(self.model)
        self._init_long_context(self.processing_class.pad_token_id)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, output_dir: str | None = None):
        """Write README.md (`trl_longrm.model_card.disrm_model_card`) into `output_dir` (default `args.output_dir`, where
        RewardTrainer writes its card at each checkpoint): base model, data, a scoring snippet correct for this
        checkpoint, the LongRM citation. `dataset_name` defaults to the one given to `set_dataset_name` (the CLI
        passes its `dataset_name`)."""
        import os

        from trl.trainer.utils import get_config_model_id

        from trl_longrm.model_card import disrm_model_card

        if not self.is_world_process_zero():
            return
        output_dir = output_dir or self.args.output_dir
        model_id = self.args.hub_model_id or output_dir
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        card = disrm_model_card(
            model_id,
            base_model=get_config_model_id(self.model.config) or None,
            dataset_name=dataset_name or getattr(self, "_dataset_name", None),
            trainer_name=type(self).__name__,
            tags=[*tags, *self._tag_names],
        )
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(card)

    def set_dataset_name(self, name: str | None) -> None:
        """The training data's name for the model card."""
        self._dataset_name = name

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        # The saved model gets its card too (RewardTrainer writes one only at checkpoints, into args.output_dir).
        self.create_model_card(output_dir=output_dir or self.args.output_dir)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        # RewardTrainer's processed columns (`chosen_ids` / `rejected_ids`) where each group has one rejected response.
        return prepare_preference_dataset(dataset, processing_class, args, dataset_name, stock_columns="reward")

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = [*GROUP_COLUMNS, *REWARD_COLUMNS, "margin", "num_tokens"]
            # The lengths transformers' length-grouped samplers read (`common.with_sampler_lengths`).
            self._signature_columns.append(self.args.length_column_name)

    def sequence_scores(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Score of every sequence of the batch, `[S]`, from the hidden state at its last token."""
        return self.forward_sequence_scores(model, batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        scores = self.sequence_scores(model, inputs)
        num_groups = int(inputs["group_index"].max().item()) + 1
        chosen, rejected, mask = group_values(scores, inputs["group_index"], inputs["response_index"], num_groups)
        losses = bradley_terry_loss(
            chosen,
            rejected,
            mask,
            gamma=self.args.gamma,
            margin=inputs.get("margin"),
            reject_aggregation=self.args.reject_aggregation,
        )
        loss = losses.mean()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * center_rewards_penalty(chosen, rejected, mask)

        with torch.no_grad():
            if mode == "train":
                self._total_train_tokens += self._count_tokens(inputs)
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            rejected_mean = (rejected * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            beat_all = (chosen.unsqueeze(-1) > rejected.masked_fill(~mask, float("-inf"))).all(-1)
            rows = inputs["group_row"]
            reduced = reduce_over_rows(
                self.gather_for_metrics,
                {
                    "reward": (scores, rows[inputs["group_index"]]),
                    "accuracy": ((chosen > rejected_mean).float(), rows),
                    "accuracy_vs_all": (beat_all.float(), rows),
                    "margin": (chosen - rejected_mean, rows),
                },
                num_rows=int(rows.max().item()) + 1,
            )
            self._metrics[mode]["min_reward"].append(reduced["reward"]["min"])
            self._metrics[mode]["mean_reward"].append(reduced["reward"]["mean"])
            self._metrics[mode]["max_reward"].append(reduced["reward"]["max"])
            for name in ("accuracy", "accuracy_vs_all", "margin"):
                self._metrics[mode][name].append(reduced[name]["mean"])
        if return_outputs:
            rejected_mean = (rejected * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            return loss, {"scores": scores, "group_scores": torch.stack([chosen, rejected_mean], dim=-1)}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Loss, and for `compute_metrics` / `predict()` each group's `[chosen score, mean rejected score]` (`[G, 2]`,
        RewardTrainer's chosen/rejected pair when k = 1) with zero labels (the chosen one is right)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        scores = outputs["group_scores"].detach()
        return loss.detach(), scores, torch.zeros(scores.shape[0], device=scores.device)
