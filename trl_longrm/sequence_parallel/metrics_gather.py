"""Gathering values for metrics when the ranks of a sequence-parallel group hold the same rows.

accelerate's `gather_for_metrics` gathers over the whole world and, at the end of a dataloader, keeps the first
`len(dataset) % total_batch_size` items to drop the samples it repeated to even out the last batch. Under sequence
parallelism every rank of a group holds the same rows, so a world gather counts each row once per rank of its group,
and the trim (computed for the data-parallel replicas, since our dataloaders are sharded over them) then keeps
duplicates and drops real rows. Here the values are gathered over the data-parallel group of this rank's place in
its sequence-parallel group (ranks `p, p + sp, p + 2 sp, ...`: one rank per replica, in replica order), which is
what a world gather is without sequence parallelism; then trimmed as accelerate trims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply

from .collectives import all_gather_dim0


def _is_all_tensors(data) -> bool:
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def gather_over_replicas(data, groups, use_gather_object: bool = False):
    """`data` (a tensor, or nested lists/tuples/dicts of tensors; any picklable objects with `use_gather_object`)
    of every data-parallel replica, concatenated along the first dimension in replica order, as `accelerate.utils.gather`
    concatenates the world's. Tensors must have the same shape on every replica (pad first, as the HF Trainer does);
    a 0-dim tensor becomes one item. Objects are gathered as `gather_object` does (each replica's list, flattened)."""
    size, group = groups.data_parallel_size, groups.data_parallel_group
    if use_gather_object or not _is_all_tensors(data):
        if size == 1:
            return list(data) if isinstance(data, (list, tuple)) else [data]
        gathered = [None] * size
        dist.all_gather_object(gathered, data, group=group)
        return [item for replica in gathered for item in replica]

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        return tensor if size == 1 else all_gather_dim0(tensor.contiguous(), group)

    return recursively_apply(gather, data)


def gather_for_metrics(accelerator, groups, data, use_gather_object: bool = False):
    """`accelerator.gather_for_metrics(data)` for a run whose sequence-parallel `groups` (a `SequenceParallelGroups`)
    hold each row on several ranks: every row once, the repeated samples of the last batch dropped. Without sequence
    parallelism (`groups` None or of size 1), accelerate's own.

    Example:
    ```python
    >>> predictions = gather_for_metrics(trainer.accelerator, trainer.sp_groups, predictions)
    ```
    """
    if groups is None or not groups.enabled:
        return accelerator.gather_for_metrics(data, use_gather_object=use_gather_object)
    objects = use_gather_object or not _is_all_tensors(data)
    data = gather_over_replicas(data, groups, use_gather_object=objects)
    state = accelerator.gradient_state
    # The trim of `Accelerator.gather_for_metrics`: `remainder` is counted over the batch sampler's processes, which
    # our dataloaders set to the data-parallel replicas (`SequenceParallelMixin._shard_by_data_parallel_rank`).
    if not state.end_of_dataloader or state.remainder <= 0:
        return data
    if objects:
        return data[: state.remainder]
    return recursively_apply(lambda tensor: tensor[: state.remainder], data)
