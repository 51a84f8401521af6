"""Run by torchrun from `tests/test_multinode.py`: ring groups of 2 and one ring-attention forward, recorded per rank.

Usage: `torchrun ... tests/multinode_worker.py OUT_DIR` (writes `OUT_DIR/rank{R}.json`).
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
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = init_sequence_parallel_groups(2)
    tokenizer = build_chat_tokenizer()
    # Each ring its own packed row of two documents (by its data-parallel rank), the same on both ranks of a ring.
    generator = torch.Generator().manual_seed(groups.data_parallel_rank)
    ids = torch.randint(5, len(tokenizer), (1, 23), generator=generator)
    positions = torch.cat([torch.arange(10), torch.arange(13)])[None]
    config = SequenceParallelConfig(sequence_parallel_size=2, ring_head_stride=1)
    model = apply_ring_attention(build_tiny_model("llama", "causal-lm", tokenizer, seed=0), config)
    shard = shard_packed_row(ids, positions, ids, groups=groups, config=config, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(**shard.model_inputs()).logits
    logps = torch.log_softmax(logits.float(), -1).gather(-1, shard.shift_labels.clamp(min=0).unsqueeze(-1))
    row = gather_sequence(logps.squeeze(-1), shard.attention_meta)
    record = {
        "rank": rank,
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "ring_ranks": list(groups.ring_ranks),
        "data_parallel_rank": groups.data_parallel_rank,
        "logps": row[0].tolist(),
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
