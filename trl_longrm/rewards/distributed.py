"""Whole groups on any number of processes: the rows of a reward call gathered from every process of a
`torch.distributed` run, the groups dealt out among the processes, each judged once, and the rewards sent back to the
rows' owners.

TRL's GRPO/RLOO spread one prompt's G generations over several processes (`RepeatSampler` with accelerate's
sharding) and call each reward function on a process's own rows before gathering the rewards; a judge comparing a
group's completions must see them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class ProcessGroupExchange:
    """Python objects exchanged among the processes of the default `torch.distributed` group, on a gloo group of its
    own (created at the first exchange, by every process in the same order since every process calls the reward
    function at each step): the rows travel on CPU whatever the training backend, and the exchanges of one reward
    function never interleave with the trainer's or another function's collectives.

    Outside a distributed run (or with one process) there is nothing to exchange: `world_size` is 1.

    Example:
    ```python
    >>> exchange = ProcessGroupExchange()
    >>> everyone = exchange.all_gather(my_rows)  # one entry per process, in rank order
    ```
    """

    def __init__(self):
        self._group = None

    @staticmethod
    def _distributed():
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None

    @property
    def world_size(self) -> int:
        dist = self._distributed()
        return dist.get_world_size() if dist else 1

    @property
    def rank(self) -> int:
        dist = self._distributed()
        return dist.get_rank() if dist else 0

    def all_gather(self, value: Any) -> list:
        """`value` of every process, in rank order."""
        dist = self._distributed()
        if dist is None or dist.get_world_size() == 1:
            return [value]
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered


def deal_groups(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """The groups each process judges: group indices dealt so that the processes' total costs are even (the costliest
    group first to the least loaded process, ties to the lower rank), each process's groups in batch order.

    Example:
    ```python
    >>> deal_groups([56, 56, 1, 1], 2)
    [[0, 2], [1, 3]]
    ```
    """
    loads = [0.0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for group in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(group)
        loads[rank] += costs[group]
    return [sorted(share) for share in shares]


def judge_whole_groups(
    exchange: ProcessGroupExchange,
    rows: Sequence[tuple],
    groups_of: Callable[[list[tuple]], list[list[int]]],
    cost_of: Callable[[list[tuple], list[int]], float],
    judge: Callable[[list[tuple]], tuple[list, dict]],
) -> tuple[list, dict, Any]:
    """This process's rewards, each group judged whole and once among all processes.

    `rows` are this process's rows; `groups_of(all_rows)` groups the rows of every process (indices into them),
    `cost_of(all_rows, group)` weighs a group for the dealing, and `judge(some_rows)` returns one reward per row and a
    dict of counters (summed over the processes). Returns this process's rewards (in its rows' order), the counters
    summed over every process, and what `judge` returned on this process (its own share).

    A judge that raises on one process raises on every process (the message of the first failing rank), so that no
    process waits forever for the others' rewards."""
    everyone = exchange.all_gather(list(rows))
    offsets, all_rows = [], []
    for share in everyone:
        offsets.append(len(all_rows))
        all_rows.extend(share)
    groups = groups_of(all_rows)
    mine = deal_groups([cost_of(all_rows, group) for group in groups], exchange.world_size)[exchange.rank]
    indices = sorted(i for g in mine for i in groups[g])
    try:
        rewards, counters, own = judge([all_rows[i] for i in indices])
        result = ("ok", indices, rewards, counters)
    except Exception as error:  # shared so that every process stops with it instead of waiting
        own, result = None, ("error", type(error).__name__, str(error), error)
    answers = exchange.all_gather(result if result[0] == "ok" else result[:3])
    for rank, answer in enumerate(answers):
        if answer[0] == "error":
            if rank == exchange.rank:
                raise result[3]
            from trl_longrm.serving.base import EngineError

            raise EngineError(f"The judge failed on process {rank}: {answer[1]}: {answer[2]}")
    all_rewards: list = [None] * len(all_rows)
    totals: dict = {}
    for _, indices, rewards, counters in answers:
        for index, reward in zip(indices, rewards, strict=True):
            all_rewards[index] = reward
        for key, value in counters.items():
            totals[key] = totals.get(key, 0) + value
    start = offsets[exchange.rank]
    return all_rewards[start : start + len(rows)], totals, own
