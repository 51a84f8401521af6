"""What makes the three trainers long: packed rows through the ring attention, optionally split over a ring group of
processes (sequence parallelism), with data sharded by data-parallel rank and values gathered across the ring.

The mixin goes first in a trainer's bases so that its dataloader and batch-size overrides win over the HF Trainer's:
`class SimPOGRMTrainer(SequenceParallelMixin, CPOTrainer)`.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import weakref

import torch
from accelerate.data_loader import BatchSamplerShard

from trl_longrm.fused_lora import apply_fused_lora
from trl_longrm.heads import shift_labels_left
from trl_longrm.memory.lora_input_cast import skip_lora_input_casts_under_autocast
from trl_longrm.memory.tiled_mlp import apply_tiled_mlp
from trl_longrm.packing import is_shared_prefix_batch
from trl_longrm.sequence_parallel import (
    RING_META_KWARG,
    apply_ring_attention,
    gather_sequence,
    init_sequence_parallel_groups,
    shard_packed_row,
    validate_sequence_parallel_setup,
)
from trl_longrm.sequence_parallel.collectives import all_reduce_autograd, destroy_process_groups
from trl_longrm.sequence_parallel.metrics_gather import gather_for_metrics
from trl_longrm.sequence_parallel.sharding import packed_row_metadata, shared_row_metadata
from trl_longrm.trainers.common import model_inputs


logger = logging.getLogger(__name__)


def release_process_groups_at_exit(trainer_ref: weakref.ref) -> None:
    """At interpreter exit: drop the trainer's DDP / DeepSpeed wrappers, then destroy the process groups.

    A gloo group's worker threads can hold the last (C++) reference to the tensors of the last collective (the HF
    Trainer's `store_flos` all-gather ends every `train()`); releasing them needs the GIL, and a worker that asks for it
    once the interpreter is finalising is killed mid-destructor: "terminate called without an active exception",
    SIGABRT, and the launcher reports a finished run as failed (2-replica DDP runs: 11 in 100, `bench/clean_exit.py`).
    Destroying a group joins its threads with the GIL released, but only once nothing references it: the DDP wrapper
    does (its reducer keeps the group), hence the wrappers first. Registered by each trainer with a weak reference
    (atexit does not keep the trainer alive); the groups are destroyed once, by the first call."""
    trainer = trainer_ref()
    if trainer is not None:
        trainer.model_wrapped = trainer.model
        trainer.optimizer = trainer.lr_scheduler = None  # a ZeRO optimizer keeps its groups too
        if getattr(trainer, "deepspeed", None) is not None:
            trainer.deepspeed = None
        trainer.accelerator.free_memory()  # accelerate's references to the wrapped model, optimizer, engine; gc
    destroy_process_groups()
    gc.collect()  # groups kept alive only by reference cycles are destroyed (joined) now, not in finalisation


class SequenceParallelMixin:
    """Ring groups, ring attention, per-ring data and sharded forwards, shared by the LongRM trainers."""

    sp_groups = None

    def _init_long_context(self, pad_token_id: int) -> None:
        """Call at the end of `__init__`, once the accelerator (and so the process group) exists."""
        args = self.args
        self._pad_token_id = pad_token_id
        ddp = getattr(self.accelerator, "ddp_handler", None)
        if ddp is not None:
            # Gradients as views of DDP's all-reduce buckets instead of separate tensors copied into them: one
            # model-sized copy of the gradients less on every rank (0.3 GiB of the 1.25 GiB per-rank floor of the
            # 79M-parameter benchmark model). Read when accelerate wraps the model, in `train()`.
            ddp.gradient_as_bucket_view = True
        if self.accelerator.num_processes == 1 and self.accelerator.dispatch_batches is None:
            # accelerate "dispatches" a streamed (IterableDataset) batch even on one process: it slices every tensor
            # of the batch to the batch size read off its first tensor, which for a padding-free batch ([1, tokens])
            # would cut the per-sequence lengths and attention metadata to their first entry. With one process there
            # is nothing to dispatch (streams over several processes are refused).
            self.accelerator.dataloader_config.dispatch_batches = False
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Process groups destroyed at exit, not left to the interpreter's finalisation (which can abort a gloo
            # rank after a successful run: `release_process_groups_at_exit`).
            atexit.register(release_process_groups_at_exit, weakref.ref(self))
        sp = args.sequence_parallel_size
        packed_for_sp = False
        if sp > 1 and not args.padding_free:
            if not hasattr(self.data_collator, "padding_free"):
                raise ValueError(
                    f"sequence_parallel_size={sp} splits one packed row over a group of processes; it needs "
                    "`padding_free=True` (or our collator, which lays the batch out in one row)."
                )
            # A padded micro-batch and the same sequences end to end in one row give the same loss (the padding is
            # never attended nor scored): the row is what a group of processes can split. Stock SFTTrainer under
            # accelerate's Ulysses trains padded batches too.
            self.data_collator.padding_free = packed_for_sp = True
            logger.info(
                "padding_free=False with sequence_parallel_size=%d: each micro-batch is laid out in one row (no "
                "padding, the same loss) to be split over the group.",
                sp,
            )
        replicas = getattr(args, "_accelerate_replicas", 1)
        if sp > 1 and replicas > 1 and replicas * sp != self.accelerator.num_processes:
            raise ValueError(
                f"parallelism_config sets dp_replicate_size={replicas} and sp_size={sp}, but the run has "
                f"{self.accelerator.num_processes} processes: the replicas are num_processes / sp_size = "
                f"{self.accelerator.num_processes // sp}. Fix dp_replicate_size (or leave it out)."
            )
        if sp > 1:
            validate_sequence_parallel_setup(self.model, args, self.accelerator.num_processes)
            self.sp_groups = init_sequence_parallel_groups(sp, args.sequence_parallel_mode, args.ulysses_size)
        if args.padding_free or packed_for_sp:
            # Our attention keeps the documents of a packed row apart without an L x L mask (and runs the ring).
            apply_ring_attention(self.model, args)
        apply_tiled_mlp(self.model, getattr(args, "mlp_tile_tokens", None))
        # Exact (bit for bit) and less memory: no float32 copy of each LoRA layer's input under autocast.
        skip_lora_input_casts_under_autocast(self.model)
        if getattr(args, "fused_lora", False):
            apply_fused_lora(self.model)

    @property
    def sequence_parallel_size(self) -> int:
        return self.sp_groups.sequence_parallel_size if self.sp_groups is not None else 1

    # ------------------------------------------------------------------ data: one row per ring, disjoint per replica

    def _shard_by_data_parallel_rank(self, dataloader):
        if self.sp_groups is None:
            return dataloader
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        if not isinstance(batch_sampler, BatchSamplerShard):
            raise ValueError(
                "Sequence parallelism needs a map-style dataset (a `datasets.Dataset`), so that every rank of a ring "
                "receives the same packed row."
            )
        # accelerate shards batches over every process; ranks of one ring must share a batch instead.
        batch_sampler.num_processes = self.sp_groups.data_parallel_size
        batch_sampler.process_index = self.sp_groups.data_parallel_rank
        if self.sp_groups.data_parallel_size == 1:
            # One replica reads the data as one process does: accelerate would complete the epoch's last, short batch
            # with rows from the start (to even out batches over processes), which one process never trains on and,
            # in a packed row, `gather_for_metrics` cannot cut off again.
            batch_sampler.even_batches = False
        return dataloader

    def get_train_dataloader(self):
        return self._shard_by_data_parallel_rank(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._shard_by_data_parallel_rank(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._shard_by_data_parallel_rank(super().get_test_dataloader(test_dataset))

    def get_total_train_batch_size(self, args) -> int:
        # Ring ranks train on the same rows: the global batch counts data-parallel replicas only.
        return super().get_total_train_batch_size(args) // self.sequence_parallel_size

    # ------------------------------------------------------------------ metrics and counters: every row once

    def gather_for_metrics(self, data, use_gather_object: bool = False):
        """`accelerator.gather_for_metrics`, counting each row once when the ranks of a sequence-parallel group hold
        the same rows (`trl_longrm.sequence_parallel.metrics_gather`); accelerate's own without sequence parallelism.
        Every metric, prediction and counter of the trainers goes through it."""
        return gather_for_metrics(self.accelerator, self.sp_groups, data, use_gather_object=use_gather_object)

    def evaluation_loop(self, *args, **kwargs):
        # The HF Trainer gathers losses, predictions and labels with `self.gather_function`, and resets it to
        # accelerate's after every loop: set ours for each loop.
        if self.sp_groups is not None:
            self.gather_function = functools.partial(
                self.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
            )
        return super().evaluation_loop(*args, **kwargs)

    def _track_num_input_tokens(self, inputs):
        # The HF Trainer sums every rank's (unsplit) batch over the world: each row once per rank of its group.
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        added = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + added // self.sequence_parallel_size

    def floating_point_ops(self, inputs) -> float:
        # Each rank of a group computes its share of the row; `store_flos` sums the ranks' counts over the world.
        return super().floating_point_ops(inputs) / self.sequence_parallel_size

    def _count_tokens(self, batch) -> int:
        """Real tokens of this step over all data-parallel replicas (each rank of a group holds the same row): the
        tokens placed in the row, so a shared prompt counts once."""
        if is_shared_prefix_batch(batch):
            placed = batch["segment_lengths"].sum()
        else:
            placed = batch["sequence_lengths"].sum()
        return int(self.gather_for_metrics(placed).sum().item())

    # ------------------------------------------------------------------ forwards over a whole (possibly split) row

    def _shard(self, batch, labels=None):
        segments = {}
        if is_shared_prefix_batch(batch):
            segments = {"segment_lengths": batch["segment_lengths"], "segment_parents": batch["segment_parents"]}
        return shard_packed_row(
            batch["input_ids"],
            batch["position_ids"],
            labels,
            groups=self.sp_groups,
            config=self.args,
            pad_token_id=self._pad_token_id,
            **segments,
        )

    def _shared_row_inputs(self, batch) -> dict:
        """Model inputs of a shared-prefix row on one process: its documents are not readable from `position_ids`
        (a response continues its prompt's positions), so the ring attention always receives them as metadata."""
        meta = shared_row_metadata(batch["segment_lengths"], batch["segment_parents"], self.args)
        return {
            "input_ids": batch["input_ids"],
            "position_ids": batch["position_ids"],
            RING_META_KWARG: meta,
            "use_cache": False,
        }

    def _packed_row_inputs(self, batch) -> dict:
        """Model inputs of a batch on one process. A packed row (padding-free, one row) comes with its attention
        metadata, built once here in the user's ring settings (`ring_attn_backend`, ...): every layer, and the
        recompute of gradient checkpointing, reads it instead of deriving the documents from `position_ids` again
        (a host sync per layer)."""
        inputs = {**model_inputs(batch), "use_cache": False}
        position_ids = inputs.get("position_ids")
        packed_row = position_ids is not None and position_ids.shape[0] == 1 and "attention_mask" not in inputs
        if self.args.padding_free and packed_row:
            inputs[RING_META_KWARG] = packed_row_metadata(position_ids, self.args)
        return inputs

    def forward_pair_logps(self, model, batch) -> torch.Tensor:
        """Log-prob of `logprob_targets[p]` at row position `logprob_positions[p]` of a shared-prefix batch, `[P]`,
        for the whole row even when it is split over a ring."""
        positions, targets = batch["logprob_positions"], batch["logprob_targets"]
        if self.sp_groups is None:
            inputs = self._shared_row_inputs(batch)
            return model(**inputs, logprob_positions=positions, logprob_targets=targets).token_logps
        shard = self._shard(batch)
        meta = shard.attention_meta
        where = meta.local_positions(positions)  # this rank's index of each scored position, -1 elsewhere
        local = where >= 0
        local_positions, local_targets = where[local], targets[local]
        if not local.any():
            # As in `forward_token_logps`: a rank without any scored position must still take part in the attention's
            # backward collectives, so it scores a dummy position whose value is multiplied by zero.
            local_positions, local_targets = positions.new_zeros(1), targets.new_zeros(1)
        output = model(**shard.model_inputs(), logprob_positions=local_positions, logprob_targets=local_targets)
        if local.any():
            values = output.token_logps.new_zeros(positions.shape).masked_scatter(local, output.token_logps)
        else:
            values = output.token_logps.new_zeros(positions.shape) + 0.0 * output.token_logps.sum()
        return all_reduce_autograd(values, meta.group)

    def forward_token_logps(self, model, batch, with_stats: bool = False):
        """Per-position log-prob of the next token (`[B, L]`, 0 where unscored) and the mask of scored positions,
        for the whole row even when it is split over a ring. With `with_stats`, also whether each label is the
        arg-max and the entropy of each prediction (`[B, L]`, 0 where unscored, no gradient: TRL's
        `mean_token_accuracy` and `entropy`)."""
        if is_shared_prefix_batch(batch):
            raise ValueError(
                "A shared-prefix batch has no per-token labels: read its log-probs with forward_pair_logps."
            )
        if self.sp_groups is None:
            output = model(**self._packed_row_inputs(batch), logprob_labels=batch["labels"], logprob_metrics=with_stats)
            if with_stats:
                return output.token_logps, output.label_mask, output.is_top1, output.entropy
            return output.token_logps, output.label_mask
        shard = self._shard(batch, batch["labels"])
        scored = shard.shift_labels != -100
        shift_labels = shard.shift_labels
        if not scored.any():
            # A slice without any scored token (say, the head of a long prompt) must still be connected to the
            # backbone's graph: the backward of every ring rank takes part in the attention's key/value
            # reduce-scatter, and a rank whose loss has no graph would skip it (no grad_fn, or a hang). Score one
            # dummy position and mask it out below.
            shift_labels = torch.where(torch.arange(scored.shape[1], device=scored.device) == 0, 0, shift_labels).to(
                shift_labels.dtype
            )
        output = model(**shard.model_inputs(), logprob_shift_labels=shift_labels, logprob_metrics=with_stats)
        local = torch.where(scored, output.token_logps, 0.0)
        # The gather's backward sums every rank's contribution: averaging gradients over the world is then exact.
        token_logps = gather_sequence(local, shard.attention_meta)
        label_mask = shift_labels_left(batch["labels"]) != -100
        if not with_stats:
            return token_logps, label_mask
        with torch.no_grad():
            is_top1 = gather_sequence(torch.where(scored, output.is_top1, False).to(local.dtype), shard.attention_meta)
            entropy = gather_sequence(torch.where(scored, output.entropy, 0.0), shard.attention_meta)
        return token_logps, label_mask, is_top1.bool(), entropy

    def forward_logits(self, model, batch) -> torch.Tensor:
        """The model's vocabulary logits over the whole row (`[B, L, V]`), even when it is split over a ring: what the
        HF Trainer's `compute_metrics` / `predict()` receive. (Not used by the losses, which read sparse log-probs.)"""
        if self.sp_groups is None:
            return model(**self._packed_row_inputs(batch)).logits
        shard = self._shard(batch)
        return gather_sequence(model(**shard.model_inputs()).logits, shard.attention_meta)

    def forward_sequence_scores(self, model, batch) -> torch.Tensor:
        """Score of every sequence of the batch, `[S]`, read at its last token, even when the row is split."""
        if self.sp_groups is None:
            if is_shared_prefix_batch(batch):
                return model(**self._shared_row_inputs(batch), score_positions=batch["score_positions"]).scores
            return model(**self._packed_row_inputs(batch), score_positions=batch["score_positions"]).scores
        shard = self._shard(batch)
        local = torch.arange(shard.input_ids.shape[1], device=shard.input_ids.device)
        local_scores = model(**shard.model_inputs(), score_positions=local).scores
        scores = gather_sequence(local_scores.unsqueeze(0), shard.attention_meta)[0]
        return scores[batch["score_positions"]]
