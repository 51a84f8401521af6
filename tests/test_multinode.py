"""Several machines: rings never span nodes, simulated with two torchrun "nodes" of 2 processes on localhost."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_longrm.sequence_parallel import check_rings_within_nodes
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks


ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("multinode_worker.py")
PRELOAD = ("trl_longrm.testing_utils",)  # the fork server is shared with the other gloo tests: same list


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def torchrun(out_dir, nnodes, nproc_per_node, fails=False, layout="ring2"):
    """Start `nnodes` torchrun agents on this host (one per simulated node) and wait for all of them; with `fails`,
    return their stderr, which must come with a failure."""
    out_dir.mkdir()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nnodes),
                "--node_rank",
                str(node),
                "--nproc_per_node",
                str(nproc_per_node),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                str(WORKER),
                str(out_dir),
                layout,
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in range(nnodes)
    ]
    errors = ""
    for agent in agents:
        _, err = agent.communicate(timeout=600)
        assert (agent.returncode != 0) == fails, err[-4000:]
        errors += err
    if fails:
        return errors
    return records(out_dir)


def records(out_dir):
    """Each rank's record written by the worker, by rank."""
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in out_dir.glob("rank*.json"))}


def one_node(out_dir, processes, layout="ring2"):
    """The reference: one node of `processes` gloo ranks (forked, as the other multi-process tests' ranks are)."""
    import multinode_worker

    out_dir.mkdir()
    run_on_gloo_ranks(multinode_worker.one_node_rank, processes, str(out_dir), layout, timeout=600, preload=PRELOAD)
    return records(out_dir)


def test_a_ring_larger_than_a_node_or_straddling_two_is_refused():
    check_rings_within_nodes(8, 8)
    check_rings_within_nodes(2, 8)
    for ring, per_node in ((16, 8), (3, 8), (4, 2)):
        with pytest.raises(
            ValueError, match=f"sequence_parallel_size={ring} does not divide the {per_node} processes"
        ):
            check_rings_within_nodes(ring, per_node)


@pytest.mark.slow
def test_two_nodes_keep_each_ring_on_one_node_and_match_one_node(tmp_path):
    two_nodes = torchrun(tmp_path / "two", nnodes=2, nproc_per_node=2)
    one = one_node(tmp_path / "one", 4)
    assert sorted(two_nodes) == sorted(one) == [0, 1, 2, 3]
    for rank, record in two_nodes.items():
        # Ranks are numbered node by node: ring [0, 1] on node 0, ring [2, 3] on node 1.
        assert record["node"] == rank // 2 and record["ring_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert {two_nodes[r]["node"] for r in record["ring_ranks"]} == {record["node"]}
        # The same row on the same ranks gives the same log-probs as on one node of 4 processes.
        assert record["ring_ranks"] == one[rank]["ring_ranks"]
        torch.testing.assert_close(torch.tensor(record["logps"]), torch.tensor(one[rank]["logps"]))
    # Both ranks of a ring hold the whole row's log-probs; the two rings hold different rows.
    assert two_nodes[0]["logps"] == two_nodes[1]["logps"] and two_nodes[0]["logps"] != two_nodes[2]["logps"]


@pytest.mark.slow
def test_hybrid_keeps_ulysses_pairs_on_a_node_and_rings_across_nodes(tmp_path):
    """The hybrid's point: the all-to-all inside a machine, the ring across machines (allowed in this mode)."""
    hybrid = torchrun(tmp_path / "hybrid", nnodes=2, nproc_per_node=2, layout="hybrid4")
    ring = one_node(tmp_path / "ring", 4, layout="ring4")
    for rank, record in hybrid.items():
        assert record["ulysses_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert {hybrid[r]["node"] for r in record["ulysses_ranks"]} == {record["node"]}
        assert record["ring_ranks"] == [0, 1, 2, 3]  # the group spans both nodes
        # The same row gives the same log-probs as a ring of 4 on one node.
        torch.testing.assert_close(torch.tensor(record["logps"]), torch.tensor(ring[rank]["logps"]))


@pytest.mark.slow
def test_a_ring_across_two_nodes_is_refused_at_launch(tmp_path):
    # One process per node and a ring of 2: the ring would join the two nodes.
    err = torchrun(tmp_path / "across", nnodes=2, nproc_per_node=1, fails=True)
    assert "sequence_parallel_size=2 does not divide the 1 processes per machine: a ring would span machines" in err


@pytest.mark.parametrize("kind,stage", [("ddp", None), ("zero2", 2), ("zero3", 3)])
def test_two_node_accelerate_configs(kind, stage):
    from accelerate.commands.config.config_args import load_config_from_file

    from trl_longrm.train import parse_args

    config = load_config_from_file(str(ROOT / "accelerate_configs" / f"multi_node_{kind}.yaml"))
    assert (config.num_machines, config.num_processes, config.machine_rank) == (2, 16, 0)
    assert config.distributed_type == ("DEEPSPEED" if stage else "MULTI_GPU")
    assert (config.deepspeed_config or {}).get("zero_stage") == stage
    # The paper's ring of 8 stays within a machine of 16 / 2 = 8 processes.
    _, args, _ = parse_args([str(ROOT / "recipes" / "simpo_grm.yaml"), "--dry_run"])
    check_rings_within_nodes(args.sequence_parallel_size, config.num_processes // config.num_machines)
