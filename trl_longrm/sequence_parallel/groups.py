"""Process groups for data parallelism x sequence parallelism.

The world is split into rings of `sequence_parallel_size` contiguous ranks ([0..sp-1], [sp..2sp-1], ...). The ranks of
one ring hold the same packed row, each a contiguous slice of it. Ranks with the same position in their ring form a
data-parallel group (they see different rows). A ring never spans machines: every attention layer passes keys and
values around it, which the link between machines is far too slow for. Launchers number ranks machine by machine,
so rings stay on one machine when their size divides the processes per machine; this is checked, not assumed.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from .config import check_sequence_parallel_mode, ulysses_group_size


def check_sequence_parallel_size(sequence_parallel_size: int, world_size: int) -> None:
    """Raise a clear error unless `sequence_parallel_size` is a positive divisor of `world_size`.

    Example:
    ```python
    >>> check_sequence_parallel_size(2, 4)  # fine
    >>> check_sequence_parallel_size(3, 4)  # raises ValueError
    ```
    """
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be a positive integer, got {sequence_parallel_size!r}.")
    if world_size % sequence_parallel_size != 0:
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} does not divide the world size {world_size}: the "
            f"world is split into rings of sequence_parallel_size contiguous ranks, so the number of processes must "
            f"be a multiple of it (for example {sequence_parallel_size * max(1, world_size // sequence_parallel_size)})."
        )


def check_rings_within_nodes(sequence_parallel_size: int, processes_per_node: int) -> None:
    """Raise a clear error unless rings of `sequence_parallel_size` contiguous ranks fit within machines of
    `processes_per_node` processes (torchrun's `LOCAL_WORLD_SIZE`), i.e. unless the ring size divides it.

    Example:
    ```python
    >>> check_rings_within_nodes(8, 8)  # fine: one ring per 8-GPU machine
    >>> check_rings_within_nodes(16, 8)  # raises ValueError: a ring would span two machines
    ```
    """
    if processes_per_node % sequence_parallel_size:
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} does not divide the {processes_per_node} processes per "
            "machine: a ring would span machines, and ring attention passes keys and values around the ring in "
            f"every layer, which is only fast within a machine. Use a ring of a divisor of {processes_per_node}."
        )


def _check_ring_nodes(world_size: int, sequence_parallel_size: int) -> None:
    # Each rank says which machine it runs on (host name and torchrun's node rank, so that simulated nodes on one
    # host count as different machines); every ring must find one machine only.
    node = (socket.gethostname(), os.environ.get("GROUP_RANK", "0"))
    nodes = [None] * world_size
    dist.all_gather_object(nodes, node)
    for start in range(0, world_size, sequence_parallel_size):
        ring = range(start, start + sequence_parallel_size)
        found = sorted({nodes[r] for r in ring})
        if len(found) > 1:
            raise RuntimeError(
                f"the ring of ranks {list(ring)} spans machines {found}: the launcher numbered ranks across machines "
                "(not machine by machine), so contiguous rings are not local. Launch with torchrun/accelerate's "
                "default rank assignment."
            )


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The ring (sequence-parallel) and data-parallel groups of this process. Keep it on the trainer.

    `ring_group` is None when sequence parallelism is off (size 1); `data_parallel_group` is None when it is the
    whole world (or torch.distributed is not initialised), which torch.distributed treats as the default group.

    Example:
    ```python
    >>> groups = init_sequence_parallel_groups(2)  # after torch.distributed.init_process_group
    >>> groups.ring_rank, groups.data_parallel_rank, groups.data_parallel_size
    ```
    """

    sequence_parallel_size: int
    ring_group: dist.ProcessGroup | None
    ring_rank: int
    ring_ranks: tuple[int, ...]
    data_parallel_group: dist.ProcessGroup | None
    data_parallel_rank: int
    data_parallel_size: int
    ulysses_size: int = 1
    """Ranks of this process's Ulysses group (all-to-all over heads): 1 in 'ring' mode, the whole sequence-parallel
    group in 'ulysses' mode, `ulysses_size` consecutive ranks in 'hybrid' mode."""
    ulysses_group: dist.ProcessGroup | None = None
    ring_attention_group: dist.ProcessGroup | None = None
    """The ranks that pass keys/values around in the ring attention (same place in their Ulysses group): the whole
    `ring_group` in 'ring' mode, None in 'ulysses' mode (no ring)."""
    mode: str = "ring"

    @property
    def enabled(self) -> bool:
        """Whether rows are split over more than one process."""
        return self.sequence_parallel_size > 1


def communicator_sizes(world_size: int, sequence_parallel_size: int = 1, mode: str = "ring",
                       ulysses_size: int | None = None) -> dict[str, int]:
    """The process groups of more than one rank that each rank of a layout belongs to, by name, and their sizes: the
    world, and those `init_sequence_parallel_groups` creates (each one NCCL communicator on a GPU).

    Example:
    ```python
    >>> communicator_sizes(8, 4, "hybrid", ulysses_size=2)
    {'world': 8, 'sequence_parallel': 4, 'data_parallel': 2, 'ulysses': 2, 'ring_attention': 2}
    ```
    """
    sizes = {"world": world_size}
    if sequence_parallel_size > 1:
        local = ulysses_group_size(mode, sequence_parallel_size, ulysses_size)
        sizes.update(sequence_parallel=sequence_parallel_size, data_parallel=world_size // sequence_parallel_size,
                     ulysses=local, ring_attention=sequence_parallel_size // local if 1 < local < sequence_parallel_size else 1)  # fmt: skip
    return {name: size for name, size in sizes.items() if size > 1}


def init_sequence_parallel_groups(
    sequence_parallel_size: int, mode: str = "ring", ulysses_size: int | None = None
) -> SequenceParallelGroups:
    """Create the ring and data-parallel groups; every process of the world must call it (collectively).

    With `sequence_parallel_size == 1` no group is created and torch.distributed need not be initialised. With
    `mode='ulysses'` the sequence-parallel group is also the Ulysses group; with `mode='hybrid'` it is cut into Ulysses
    groups of `ulysses_size` consecutive ranks, and the ranks at the same place in each form the attention ring.

    Example:
    ```python
    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo")  # world of 4 processes
    >>> groups = init_sequence_parallel_groups(2)  # rings [0, 1] and [2, 3]; data-parallel groups [0, 2] and [1, 3]
    ```
    """
    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    if sequence_parallel_size != 1 and not initialized:
        raise RuntimeError(
            f"sequence_parallel_size={sequence_parallel_size} needs torch.distributed to be initialised (launch with "
            "accelerate/torchrun), but it is not."
        )
    check_sequence_parallel_size(sequence_parallel_size, world_size)
    check_sequence_parallel_mode(mode, sequence_parallel_size, ulysses_size)
    if sequence_parallel_size == 1:
        return SequenceParallelGroups(
            sequence_parallel_size=1,
            ring_group=None,
            ring_rank=0,
            ring_ranks=(rank,),
            data_parallel_group=None,
            data_parallel_rank=rank,
            data_parallel_size=world_size,
        )
    local_size = ulysses_group_size(mode, sequence_parallel_size, ulysses_size)
    # A ring passes keys/values, a Ulysses group all-to-alls q/k/v/out, in every layer: both stay on one machine;
    # in 'hybrid' mode only the Ulysses groups need to (the ring across them may span machines).
    within_node = local_size if mode == "hybrid" else sequence_parallel_size
    check_rings_within_nodes(within_node, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    _check_ring_nodes(world_size, within_node)
    dp_size = world_size // sequence_parallel_size
    ring_group = data_parallel_group = None
    ring_ranks: tuple[int, ...] = ()
    # new_group is collective over the whole world: every process creates every group, in the same order.
    for ring_index in range(dp_size):
        ranks = tuple(range(ring_index * sequence_parallel_size, (ring_index + 1) * sequence_parallel_size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            ring_group, ring_ranks = group, ranks
    for position in range(sequence_parallel_size):
        ranks = list(range(position, world_size, sequence_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            data_parallel_group = group
    ulysses_group, ring_attention_group = None, ring_group
    if local_size > 1:
        ring_attention_group = None
        for start in range(0, world_size, local_size):
            group = dist.new_group(list(range(start, start + local_size)))
            if rank in range(start, start + local_size):
                ulysses_group = group
        if local_size < sequence_parallel_size:
            for ring_index in range(dp_size):
                base = ring_index * sequence_parallel_size
                for place in range(local_size):
                    ranks = list(range(base + place, base + sequence_parallel_size, local_size))
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        ring_attention_group = group
    return SequenceParallelGroups(
        sequence_parallel_size=sequence_parallel_size,
        ring_group=ring_group,
        ring_rank=rank % sequence_parallel_size,
        ring_ranks=ring_ranks,
        data_parallel_group=data_parallel_group,
        data_parallel_rank=rank // sequence_parallel_size,
        data_parallel_size=dp_size,
        ulysses_size=local_size,
        ulysses_group=ulysses_group,
        ring_attention_group=ring_attention_group,
        mode=mode,
    )
