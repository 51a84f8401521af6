"""Stage II of the generative reward model: SimPO on judgments with several rejected judgments per prompt."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
from datasets import DatasetDict, IterableDataset


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402

from trl_longrm.data.stock_columns import CPO_COLUMNS, GROUP_COLUMNS  # noqa: E402
from trl_longrm.fused_lora import apply_fused_lora  # noqa: E402
from trl_longrm.heads import add_token_logprob_head  # noqa: E402
from trl_longrm.losses import AVERAGED_LOSS_TYPES, CPO_LOSS_TYPES, cpo_loss, group_values  # noqa: E402
from trl_longrm.memory.partial_checkpointing import check_partial_checkpointing_args
from trl_longrm.memory.selective_checkpointing import (  # noqa: E402
    check_selective_checkpointing_args,
    check_selective_checkpointing_setup,
)
from trl_longrm.memory.tiled_mlp import apply_tiled_mlp  # noqa: E402
from trl_longrm.packing import PreferenceCollator, is_shared_prefix_batch  # noqa: E402
from trl_longrm.sequence_parallel import SequenceParallelConfig  # noqa: E402
from trl_longrm.trainers.common import (  # noqa: E402
    SHARED_PREFIX_HELP,
    LongContextDataArguments,
    RejectedCountArguments,
    check_activation_offload_args,
    check_num_rejected,
    check_shared_prefix_args,
    install_activation_offload,
    install_checkpointing_switches,
    keep_heads_under_liger,
    lm_head_reasons,
    model_skeleton,
    pad_token_id_of,
    padded_fallback_args,
    per_pair_sequence_logps,
    per_sequence_logps,
    prepare_preference_dataset,
    reduce_over_rows,
    resolve_tokenizer,
    uses_shared_prefix,
)
from trl_longrm.trainers.parallel import SequenceParallelMixin  # noqa: E402


logger = logging.getLogger(__name__)


@dataclass
class SimPOGRMConfig(CPOConfig, LongContextDataArguments, RejectedCountArguments, SequenceParallelConfig):
    """Configuration of [`SimPOGRMTrainer`]: TRL's `CPOConfig` with LongRM stage II defaults and long-context data
    fields (see `LongContextDataArguments`).

    The loss is `-logsigmoid(beta * (logp_chosen - mean_k logp_rejected_k) - simpo_gamma)` on length-normalised
    log-probs (`loss_type="simpo"`; TRL's other CPO loss types and AlphaPO's `alpha` work as in `CPOTrainer`), plus
    `nll_loss_weight` (TRL's `cpo_alpha`) times the NLL of the chosen judgment.

    Example:
    ```python
    >>> from trl_longrm import SimPOGRMConfig
    >>> args = SimPOGRMConfig(output_dir="grm", max_length=131072, per_device_train_batch_size=1)
    ```
    """

    loss_type: str = field(
        default="simpo",
        metadata={
            "help": "CPO loss, as TRL's `CPOTrainer` computes it for one rejected response and against the mean "
            "reward of the k rejected ones otherwise: 'simpo' (default, LongRM: sigmoid on length-normalised "
            "log-probs minus `simpo_gamma`), 'sigmoid' (CPO: summed log-probs), 'hinge' (SLiC: summed log-probs), "
            "'ipo' (length-normalised log-probs), or 'alphapo' (TRL's shorthand: 'simpo' with `cpo_alpha=0`).",
            "choices": ["simpo", "sigmoid", "hinge", "ipo", "alphapo"],
        },
    )
    beta: float = field(default=2.5, metadata={"help": "SimPO reward scale beta. Default 2.5 (LongRM stage II)."})
    simpo_gamma: float = field(
        default=0.5, metadata={"help": "SimPO target reward margin gamma (absolute). Default 0.5 (LongRM stage II)."}
    )
    nll_loss_weight: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the token-mean NLL of the chosen judgment added to the loss (TRL's `cpo_alpha`; set "
            "either, or both to the same value). Default None: `cpo_alpha` if set, else 0.05 (LongRM)."
        },
    )
    cpo_alpha: float | None = field(
        default=None,
        metadata={
            "help": "TRL's name of `nll_loss_weight` (TRL's pure SimPO is `cpo_alpha=0.0`). Default None: "
            "`nll_loss_weight`, else 0.05 (LongRM)."
        },
    )
    max_length: int | None = field(
        default=131072,
        metadata={"help": "Most tokens of prompt + longest completion of a group. Default 131072 (LongRM)."},
    )
    learning_rate: float = field(default=2e-6, metadata={"help": "Initial AdamW learning rate. Default 2e-6."})
    shared_prefix: bool = field(default=True, metadata={"help": SHARED_PREFIX_HELP.format(default="True")})
    # TRL's RewardConfig / SFTConfig field, which CPOConfig lacks (`trl_longrm.memory.activation_offload`).
    activation_offloading: bool = field(
        default=False,
        metadata={"help": "Whether to offload the activations to the CPU."},
    )

    def __post_init__(self):
        # CPOConfig fields whose CPOTrainer code paths our token pipeline replaces: refused by name, never ignored.
        if self.max_completion_length is not None:
            raise ValueError(
                "SimPOGRMConfig does not take `max_completion_length`: judgments are never cut; `max_length` bounds "
                "prompt + longest judgment by cutting the middle of the prompt (`truncation`)."
            )
        if self.generate_during_eval:
            raise ValueError(
                "SimPOGRMConfig does not take `generate_during_eval=True`: evaluate judges with `trl-longrm eval`."
            )
        if self.loss_type == "alphapo":  # TRL's shorthand, resolved before the NLL weight it implies
            if self.nll_loss_weight not in (None, 0.0) or self.cpo_alpha not in (None, 0.0):
                raise ValueError("loss_type='alphapo' means SimPO without the NLL term; leave nll_loss_weight unset.")
            self.loss_type, self.cpo_alpha = "simpo", 0.0
        if None not in (self.nll_loss_weight, self.cpo_alpha) and self.nll_loss_weight != self.cpo_alpha:
            raise ValueError(
                f"nll_loss_weight={self.nll_loss_weight} and cpo_alpha={self.cpo_alpha} name the same weight (the NLL "
                "term's); set one of them."
            )
        weight = next((w for w in (self.nll_loss_weight, self.cpo_alpha) if w is not None), 0.05)
        self.nll_loss_weight = self.cpo_alpha = weight
        super().__post_init__()
        SequenceParallelConfig.__post_init__(self)
        check_num_rejected(self)
        check_shared_prefix_args(self)
        check_activation_offload_args(self)
        check_selective_checkpointing_args(self)
        check_partial_checkpointing_args(self)


class SimPOGRMTrainer(SequenceParallelMixin, CPOTrainer):
    """SimPO trainer for long-context generative reward models (LongRM stage II), a drop-in for TRL's `CPOTrainer`.

    Accepts every data format of `trl_longrm.data` (LongRM's `chat_template`/`chosen`/`rejects`, TRL's preference
    formats) and k >= 1 rejected responses per prompt. Sequences are packed padding-free, and the LM head is applied
    only at the judgment tokens, in chunks, so no `[tokens, vocab]` logits of a long row are materialised.

    Example:
    ```python
    >>> from trl_longrm import SimPOGRMConfig, SimPOGRMTrainer
    >>> trainer = SimPOGRMTrainer(model="path/to/sft-judge", args=SimPOGRMConfig(output_dir="grm"),
    ...                           train_dataset=dataset)
    >>> trainer.train()
    ```
    """

    _tag_names = ["trl", "trl-longrm", "simpo", "generative-reward-model"]

    def __init__(
        self,
        model=None,
        args: SimPOGRMConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        compute_metrics=None,
    ):
        if args is None:
            args = SimPOGRMConfig(output_dir="simpo-grm")
        if args.loss_type not in CPO_LOSS_TYPES:
            raise ValueError(f"SimPOGRMConfig.loss_type must be one of {list(CPO_LOSS_TYPES)}, got {args.loss_type!r}.")
        evals = eval_dataset if isinstance(eval_dataset, dict) else {"eval": eval_dataset}
        for name, data in {"train": train_dataset, **evals}.items():
            if isinstance(data, IterableDataset):
                # CPOTrainer maps its datasets with `num_proc`, which a stream's `map` does not take: stock
                # CPOTrainer fails on one too.
                raise ValueError(
                    f"{name} dataset: SimPOGRMTrainer, like CPOTrainer, needs a map-style `datasets.Dataset`; a "
                    "streaming IterableDataset is not supported. Load the data without streaming."
                )
        stock_kwargs = dict(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            model_init=model_init,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
            compute_metrics=compute_metrics,
        )
        check_selective_checkpointing_setup(args, model, peft_config)
        self._stock_path = self._use_stock_path(model, args, train_dataset, eval_dataset)
        if self._stock_path:
            super().__init__(**stock_kwargs)
            install_activation_offload(self)
            install_checkpointing_switches(self)
            apply_tiled_mlp(self.model, args.mlp_tile_tokens)  # a model-level setting: stock's forward is tiled too
            if args.fused_lora:
                apply_fused_lora(self.model)
            return
        args = padded_fallback_args(model, args, type(self).__name__)
        keep_heads_under_liger(args, type(self).__name__)
        tokenizer = resolve_tokenizer(model, processing_class, args.trust_remote_code)
        train_dataset = prepare_preference_dataset(train_dataset, tokenizer, args, "train", "cpo")
        if isinstance(eval_dataset, dict):
            # A DatasetDict stays one: CPOTrainer maps over the eval sets with `.map`.
            eval_dataset = DatasetDict(
                {k: prepare_preference_dataset(v, tokenizer, args, k, "cpo") for k, v in eval_dataset.items()}
            )
        else:
            eval_dataset = prepare_preference_dataset(eval_dataset, tokenizer, args, "eval", "cpo")
        if data_collator is None:
            data_collator = PreferenceCollator(
                pad_token_id=pad_token_id_of(tokenizer),
                padding_free=args.padding_free,
                pad_to_multiple_of=getattr(args, "pad_to_multiple_of", None),
                shared_prefix=uses_shared_prefix(args),
            )
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            model_init=model_init,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
            compute_metrics=compute_metrics,
        )
        install_activation_offload(self)
        install_checkpointing_switches(self)
        add_token_logprob_head(self.model, chunk_elements=args.logprob_chunk_elements)
        self._init_long_context(pad_token_id_of(tokenizer))
        self._total_train_tokens = 0

    def training_step(self, *args, **kwargs):
        # As TRL's RewardTrainer and SFTTrainer do: forward and backward under the activation offload context
        # (`install_activation_offload`), on either path.
        with self.maybe_activation_offload_context:
            return super().training_step(*args, **kwargs)

    def _use_stock_path(self, model, args, train_dataset, eval_dataset) -> bool:
        """Whether this model needs stock CPOTrainer's own forward (an encoder-decoder, logit scaling or softcapping,
        which our sparse LM head does not compute; a Mixture-of-Experts router loss, which stock adds): then the
        whole of CPOTrainer's path trains it, said in one logged line. It takes TRL's preference formats with one
        rejected response; with sequence parallelism, or LongRM's rows, it is an error."""
        skeleton = model_skeleton(model, args) if isinstance(model, str) else model
        reasons = lm_head_reasons(skeleton, args) if skeleton is not None else []
        config = getattr(skeleton, "config", None)
        if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0.0):
            # Stock CPOTrainer adds the router's load-balancing loss (`router_aux_loss_coef * aux_loss`), which only
            # the model's own forward returns.
            reasons.append(
                f"the model's Mixture-of-Experts router loss (output_router_logits=True, router_aux_loss_coef="
                f"{config.router_aux_loss_coef}) comes from the model's own forward"
            )
        if not reasons:
            return False
        if args.sequence_parallel_size > 1:
            raise NotImplementedError(
                f"sequence_parallel_size={args.sequence_parallel_size} needs SimPOGRMTrainer's sparse LM head, which "
                f"cannot serve this model: {'; '.join(reasons)}."
            )
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        for data in (train_dataset, *evals):
            columns = getattr(data, "column_names", None) or []
            if "rejects" in columns or "chat_template" in columns:
                raise ValueError(
                    f"This model trains through stock CPOTrainer's path ({'; '.join(reasons)}), which reads TRL's "
                    "preference formats with one rejected response; LongRM's `chat_template` / `rejects` rows need "
                    "our path. Convert them to `prompt` / `chosen` / `rejected` rows, one per rejected response."
                )
        logger.warning(
            "SimPOGRMTrainer trains through stock TRL CPOTrainer's path (its tokenisation, collator and loss: one "
            "rejected response per row, no packing or sequence parallelism) because %s.",
            "; ".join(reasons),
        )
        return True

    # The dataset is tokenised before `CPOTrainer.__init__` (its own tokeniser handles one rejected string only).
    def tokenize_row(self, feature, model=None) -> dict:
        if self._stock_path:
            return super().tokenize_row(feature, model)
        return feature

    def _set_signature_columns_if_needed(self):
        if self._stock_path:
            return super()._set_signature_columns_if_needed()
        if self._signature_columns is None:
            self._signature_columns = [*GROUP_COLUMNS, *CPO_COLUMNS, "margin", "num_tokens"]
            # The lengths transformers' length-grouped samplers read (`common.with_sampler_lengths`).
            self._signature_columns.append(self.args.length_column_name)

    def sequence_logps(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-prob and number of scored tokens of every sequence of the batch, `[S]` each."""
        if is_shared_prefix_batch(batch):
            return per_pair_sequence_logps(self.forward_pair_logps(model, batch), batch)
        token_logps, label_mask = self.forward_token_logps(model, batch)
        return per_sequence_logps(token_logps, label_mask, batch)

    def get_batch_loss_metrics(self, model, batch, train_eval: Literal["train", "eval"] = "train"):
        if self._stock_path:
            return super().get_batch_loss_metrics(model, batch, train_eval)
        loss, metrics, _ = self._loss_metrics_rewards(model, batch, train_eval)
        return loss, metrics

    def _loss_metrics_rewards(self, model, batch, train_eval):
        sums, counts = self.sequence_logps(model, batch)
        # Length-normalised log-probs for simpo and ipo, summed for sigmoid and hinge, as TRL's CPOTrainer.
        sequence_logps = sums / counts.clamp(min=1) if self.args.loss_type in AVERAGED_LOSS_TYPES else sums
        num_groups = int(batch["group_index"].max().item()) + 1
        chosen_logps, rejected_logps, rejected_mask = group_values(
            sequence_logps, batch["group_index"], batch["response_index"], num_groups
        )
        losses, chosen_rewards, rejected_rewards = cpo_loss(
            chosen_logps,
            rejected_logps,
            rejected_mask,
            loss_type=self.args.loss_type,
            beta=self.args.beta,
            gamma=self.args.simpo_gamma,
            label_smoothing=self.args.label_smoothing,
            alpha=self.args.alpha,
        )
        is_chosen = batch["response_index"] == 0
        # Token-mean NLL over the chosen judgments of the micro-batch, as TRL's CPO computes it.
        nll_loss = -sums[is_chosen].sum() / counts[is_chosen].sum().clamp(min=1)
        loss = losses.mean() + self.args.nll_loss_weight * nll_loss

        prefix = "eval_" if train_eval == "eval" else ""
        with torch.no_grad():
            beat_all = chosen_logps.unsqueeze(-1) > rejected_logps.masked_fill(~rejected_mask, float("-inf"))
            rows = batch["group_row"]
            is_chosen = batch["response_index"] == 0
            per_group = {
                "rewards/chosen": chosen_rewards,
                "rewards/rejected": rejected_rewards,
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                "rewards/accuracies_vs_all": beat_all.all(-1).float(),
                "rewards/margins": chosen_rewards - rejected_rewards,
                "logps/chosen": chosen_logps,
            }
            reduced = reduce_over_rows(
                self.gather_for_metrics,
                {
                    **{name: (v, rows) for name, v in per_group.items()},
                    # Every rejected response counts once.
                    "logps/rejected": (rejected_logps[rejected_mask], rows.unsqueeze(1).expand_as(rejected_mask)[rejected_mask]),
                    # Token-mean NLL of the chosen judgments, over the whole global batch's tokens.
                    "nll_loss": (-sums[is_chosen], rows[batch["group_index"][is_chosen]]),
                    "chosen_tokens": (counts[is_chosen], rows[batch["group_index"][is_chosen]]),
                },
                num_rows=int(rows.max().item()) + 1,
            )
            metrics = {name: reduced[name]["mean"] for name in (*per_group, "logps/rejected")}
            metrics["nll_loss"] = reduced["nll_loss"]["mean"] / max(reduced["chosen_tokens"]["mean"], 1e-12)
            tokens = self._count_tokens(batch)
            metrics["tokens_per_step"] = float(tokens)
            if train_eval == "train":
                self._total_train_tokens += tokens
        rewards = torch.stack([chosen_rewards, rejected_rewards], dim=-1)
        return loss, {prefix + k: v for k, v in metrics.items()}, rewards

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and not self._stock_path:
            logs["num_tokens"] = self._total_train_tokens  # cumulative real tokens trained, as TRL logs it
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Loss, and for `compute_metrics` / `predict()` the `[groups, 2]` rewards (chosen, mean rejected) with zero
        labels. CPO's version returns two vocabulary-logit means per batch, which the sparse LM head never computes;
        the rewards are what a preference metric needs."""
        if self._stock_path:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, metrics, rewards = self._loss_metrics_rewards(model, inputs, train_eval="eval")
        self.store_metrics(metrics, train_eval="eval")
        if prediction_loss_only:
            return loss.detach(), None, None
        return loss.detach(), rewards, torch.zeros(rewards.shape[0], device=rewards.device)
