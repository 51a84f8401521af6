"""Run by torchrun from `tests/test_multinode.py`: sequence-parallel groups and one forward, recorded per rank.

Usage: `torchrun ... tests/multinode_worker.py OUT_DIR [ring2 | ring4 | hybrid4]` (writes `OUT_DIR/rank{R}.json`):
rings of 2 (default), one ring of 4, or a group of 4 in the hybrid mode (Ulysses pairs x a ring of 2). The references
on one node run the same record in forked gloo ranks (`one_node_rank`, through `run_on_gloo_ranks`).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trl_longrm.sequence_parallel import (
    SequenceParallelConfig,
    apply_ring_attention,
    gather_sequence,
    init_sequence_parallel_groups,
    shard_packed_row,
)
from trl_longrm.sequence_parallel.launch import set_distributed_env
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model


def main(out_dir: str, layout: str = "ring2") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        record(out_dir, layout)
    finally:
        dist.destroy_process_group()


def one_node_rank(rank: int, world_size: int, out_dir: str, layout: str) -> None:
    """A rank of one node of `world_size` processes (torchrun's variables for it), in `run_on_gloo_ranks`."""
    set_distributed_env(rank, world_size)
    record(out_dir, layout)


def record(out_dir: str, layout: str) -> None:
    rank = dist.get_rank()
    size = int(layout[-1])
    mode, ulysses = ("hybrid", 2) if layout.startswith("hybrid") else ("ring", None)
    groups = init_sequence_parallel_groups(size, mode, ulysses)
    tokenizer = build_chat_tokenizer()
    # Each ring its own packed row of two documents (by its data-parallel rank), the same on both ranks of a ring.
    generator = torch.Generator().manual_seed(groups.data_parallel_rank)
    ids = torch.randint(5, len(tokenizer), (1, 23), generator=generator)
    positions = torch.cat([torch.arange(10), torch.arange(13)])[None]
    config = SequenceParallelConfig(
        sequence_parallel_size=size, sequence_parallel_mode=mode, ulysses_size=ulysses, ring_head_stride=1
    )
    model = apply_ring_attention(build_tiny_model("llama", "causal-lm", tokenizer, seed=0), config)
    shard = shard_packed_row(ids, positions, ids, groups=groups, config=config, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(**shard.model_inputs()).logits
    logps = torch.log_softmax(logits.float(), -1).gather(-1, shard.shift_labels.clamp(min=0).unsqueeze(-1))
    row = gather_sequence(logps.squeeze(-1), shard.attention_meta)
    result = {
        "rank": rank,
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "ring_ranks": list(groups.ring_ranks),
        "data_parallel_rank": groups.data_parallel_rank,
        "ulysses_ranks": [r for r in range(dist.get_world_size()) if r // groups.ulysses_size == rank // groups.ulysses_size],
        "logps": row[0].tolist(),
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
