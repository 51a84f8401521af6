"""`gather_for_metrics` under sequence parallelism on 4 gloo ranks (2 replicas x groups of 2), against hand-made
expectations: each replica's values once, in replica order, with accelerate's trim at the end of a dataloader; tensors
(nested, 0-dim) and objects (`eval_use_gather_object`)."""

import types

import pytest
import torch

from trl_longrm.sequence_parallel import init_sequence_parallel_groups
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks
from trl_longrm.sequence_parallel.metrics_gather import gather_for_metrics


def fake_accelerator(end_of_dataloader: bool, remainder: int):
    """What `gather_for_metrics` reads of an accelerator: its gradient state (the active dataloader's end and
    remainder, as accelerate computes them for the batch sampler's processes, here the replicas)."""
    state = types.SimpleNamespace(end_of_dataloader=end_of_dataloader, remainder=remainder)
    return types.SimpleNamespace(gradient_state=state)


def worker(rank: int, world_size: int, out: dict) -> None:
    groups = init_sequence_parallel_groups(2)
    replica = groups.data_parallel_rank
    # Both ranks of a group hold the same values: the replica's rows 2r and 2r + 1.
    rows = torch.tensor([2 * replica, 2 * replica + 1])
    data = {"rows": rows, "loss": torch.tensor(float(replica)), "nested": [rows * 10]}
    middle = gather_for_metrics(fake_accelerator(False, 3), groups, data)
    assert middle["rows"].tolist() == [0, 1, 2, 3], middle
    assert middle["loss"].tolist() == [0.0, 1.0]
    assert middle["nested"][0].tolist() == [0, 10, 20, 30]
    # The last batch of 3 rows over 2 replicas of 2: replica 1 holds row 2 and a repeat of row 0; keep 3.
    last = torch.tensor([[4, 5], [6, 0]][replica])
    assert gather_for_metrics(fake_accelerator(True, 3), groups, last).tolist() == [4, 5, 6]
    objects = gather_for_metrics(fake_accelerator(True, 3), groups, [f"r{replica}a", f"r{replica}b"])
    assert objects == ["r0a", "r0b", "r1a"], objects
    forced = gather_for_metrics(fake_accelerator(False, -1), groups, rows, use_gather_object=True)
    assert [int(t) for t in forced] == [0, 1, 2, 3]


@pytest.mark.slow
def test_gather_for_metrics_counts_each_row_once():
    run_on_gloo_ranks(worker, 4, {}, timeout=300, preload=("trl_longrm.testing_utils",))


def test_without_sequence_parallelism_it_is_accelerates():
    calls = []
    accelerator = types.SimpleNamespace(gather_for_metrics=lambda data, use_gather_object: calls.append(data) or data)
    data = torch.arange(3)
    assert gather_for_metrics(accelerator, None, data) is data
    assert gather_for_metrics(accelerator, init_sequence_parallel_groups(1), data) is data
    assert len(calls) == 2
