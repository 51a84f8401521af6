"""Process groups (data parallel x sequence parallel) and the autograd gather on 4 gloo processes."""

import pytest
import torch
import torch.distributed as dist

from trl_longrm.sequence_parallel import (
    all_gather_autograd,
    gather_sequence,
    init_sequence_parallel_groups,
    shard_packed_row,
)
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks


PRELOAD = ("trl_longrm.testing_utils",)  # same fork-server preload as the other multi-process tests


def _check_groups(rank, world_size):
    with pytest.raises(ValueError, match="sequence_parallel_size=3 does not divide the world size 4"):
        init_sequence_parallel_groups(3)

    flat = init_sequence_parallel_groups(1)
    assert flat.ring_group is None and (flat.data_parallel_rank, flat.data_parallel_size) == (rank, 4)

    groups = init_sequence_parallel_groups(2)
    assert groups.enabled and groups.sequence_parallel_size == 2
    assert groups.ring_ranks == ((0, 1) if rank < 2 else (2, 3))
    assert (groups.ring_rank, groups.data_parallel_rank, groups.data_parallel_size) == (rank % 2, rank // 2, 2)
    # The groups really contain those ranks: sum the global ranks over each.
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=groups.ring_group)
    assert value.item() == sum(groups.ring_ranks)
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=groups.data_parallel_group)
    assert value.item() == (rank % 2) + (rank % 2 + 2)
    return groups


def _check_gather(rank, world_size):
    # Uneven sizes (gloo needs them padded): rank r holds r + 1 values; rank-dependent upstream weights.
    x = torch.arange(rank + 1, dtype=torch.float32).add(10 * rank).requires_grad_()
    gathered = all_gather_autograd(x, None)
    assert gathered.tolist() == [0.0, 10.0, 11.0, 20.0, 21.0, 22.0, 30.0, 31.0, 32.0, 33.0]
    weights = torch.arange(10, dtype=torch.float32) * (rank + 1)
    (gathered * weights).sum().backward()
    # Backward sums every rank's gradient for my values: sum over k of (k + 1) * arange = 10 * arange.
    offset = rank * (rank + 1) // 2
    assert x.grad.tolist() == (10 * torch.arange(offset, offset + rank + 1, dtype=torch.float32)).tolist()

    # Along another dimension, 2-D.
    y = torch.full((2, rank + 1), float(rank), requires_grad=True)
    gathered = all_gather_autograd(y, None, dim=1)
    assert gathered.shape == (2, 10) and gathered[0].tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    gathered.sum().backward()
    assert torch.equal(y.grad, torch.full_like(y, 4.0))


def _check_rows(rank, world_size, groups):
    # gather_sequence trims the padding; the ring in which rank 0 holds another row is refused.
    ids = torch.arange(7)[None] + 100
    shard = shard_packed_row(ids, groups=groups)
    assert gather_sequence(shard.input_ids, shard.attention_meta).tolist() == ids.tolist()
    bad = ids + 1 if rank == 0 else ids
    if rank < 2:
        with pytest.raises(RuntimeError, match="hold different rows"):
            shard_packed_row(bad, groups=groups, source="rows of ring 0")
    else:
        shard_packed_row(bad, groups=groups)


def _groups_worker(rank, world_size):
    groups = _check_groups(rank, world_size)
    _check_gather(rank, world_size)
    _check_rows(rank, world_size, groups)


@pytest.mark.slow
def test_groups_and_gather_on_four_ranks():
    run_on_gloo_ranks(_groups_worker, 4, preload=PRELOAD)
