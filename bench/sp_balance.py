"""Load balance of the ring's placement, and the bytes each rank moves per layer (no GPU, no processes: arithmetic on
the metadata the trainers build).

For rows laid over a ring of `--ring-size` ranks by `shard_packed_row` (the placement the trainers use, and the
contiguous one for comparison), the causal
attention work of each rank is counted from its `RingAttentionMetadata`: every local query times the keys it
attends (its document's earlier tokens and itself, plus, in a shared-prefix row, its whole prefix). The balance is
max / mean over ranks (1.0 is perfect). Rows: one 131,072-token document; a packed row of several documents; a
shared-prefix row (a long prompt and 4 responses).

The bytes are those of Llama-3-8B's attention shape (32 layers, 8 key/value heads of 128, bf16) at 131,072 tokens:
per layer and rank, the keys/values all-gathered in the forward and again in the backward, and the key/value
gradients reduce-scattered (float32: they are summed over ranks in float32).

    python bench/sp_balance.py                  # one JSON line
    python bench/sp_balance.py --ring-size 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from trl_longrm.sequence_parallel import SequenceParallelConfig  # noqa: E402
from trl_longrm.sequence_parallel.sharding import attention_work, shard_packed_row  # noqa: E402


LLAMA3_8B = {"num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32, "bytes_per_value": 2}


class _Ring:
    """The `SequenceParallelGroups` fields `shard_packed_row` reads, for one rank, without processes."""

    enabled = True
    ring_group = object()

    def __init__(self, size: int, rank: int):
        self.sequence_parallel_size, self.ring_rank = size, rank


def rank_work(lengths: list[int], size: int, parents: list[int] | None = None, placement: str | None = None) -> list[int]:
    """Attention work of each rank for a row of documents `lengths` (and shared-prefix `parents`), placed as the
    trainers place it (`SequenceParallelConfig`'s default) or by `placement`."""
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.zeros_like(positions)
    segments = {}
    if parents is not None:
        segments = {"segment_lengths": torch.tensor(lengths), "segment_parents": torch.tensor(parents)}
    config = SequenceParallelConfig(sequence_parallel_size=size)
    if placement is not None:
        config.ring_placement = placement
    work = []
    for rank in range(size):
        shard = shard_packed_row(ids, positions, groups=_Ring(size, rank), config=config, verify_same_row=False,
                                 **segments)  # fmt: skip
        work.append(attention_work(shard.attention_meta))
    return work


def balance(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


def gathered_bytes(tokens: int, size: int, shape: dict = LLAMA3_8B) -> dict:
    """Bytes one rank receives (all-gather) or sends and receives (reduce-scatter) per layer."""
    row = tokens * shape["num_key_value_heads"] * shape["head_dim"] * 2  # keys and values
    others = (size - 1) / size
    return {
        "forward_gather_bytes": int(row * shape["bytes_per_value"] * others),
        "backward_gather_bytes": int(row * shape["bytes_per_value"] * others),
        "backward_reduce_scatter_bytes": int(row * 4 * others),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ring-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=131072)
    cli = parser.parse_args()
    size, tokens = cli.ring_size, cli.tokens
    rows = {
        "one_document": ([tokens], None),
        "packed_documents": ([tokens // 2, tokens // 4, tokens // 8, tokens // 16, tokens // 16], None),
        "shared_prefix": ([tokens - 4 * 2048] + [2048] * 4, [-1, 0, 0, 0, 0]),
    }
    report = {}
    for name, (lengths, parents) in rows.items():
        report[f"sp{size}_attention_balance_{name}"] = round(balance(rank_work(lengths, size, parents)), 4)
    report[f"sp{size}_attention_balance"] = report[f"sp{size}_attention_balance_one_document"]
    report[f"sp{size}_ring_placement"] = SequenceParallelConfig().ring_placement
    report[f"sp{size}_attention_balance_one_document_contiguous"] = round(balance(rank_work([tokens], size,
                                                                                         placement="contiguous")), 4)
    report.update({f"llama3_8b_{tokens // 1024}k_sp{size}_{k}": v for k, v in gathered_bytes(tokens, size).items()})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
