"""Sharding of a packed row over a ring, checked against hand-computed values (single process: the ring is described
by a `SequenceParallelGroups` whose group is never used for a collective)."""

import pytest
import torch

from trl_longrm.sequence_parallel import (
    RING_META_KWARG,
    RingAttentionMetadata,
    SequenceParallelConfig,
    SequenceParallelGroups,
    cu_seqlens_from_position_ids,
    document_starts,
    packed_row_metadata,
    shard_packed_row,
    shifted_labels,
)


IDS = torch.tensor([[10, 11, 12, 20, 21, 22, 23, 30, 31]])  # documents of 3, 4 and 2 tokens
POS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]])
LABELS = torch.tensor([[-100, 11, 12, -100, -100, 22, 23, -100, 31]])  # prompts carry no loss
# Padded to 12 for 4 ranks; label of t = label of t+1 in the same document.
SHIFTED = [11, 12, -100, -100, 22, 23, -100, 31, -100, -100, -100, -100]
DOC_IDS = [0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1, -1]
PADDED_POS = [0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]


def ring(size, rank):
    return SequenceParallelGroups(
        sequence_parallel_size=size,
        ring_group=object(),  # a stand-in: verify_same_row=False keeps it out of collectives
        ring_rank=rank,
        ring_ranks=tuple(range(size)),
        data_parallel_group=None,
        data_parallel_rank=0,
        data_parallel_size=1,
    )


def shards(size, **kwargs):
    return [
        shard_packed_row(IDS, POS, groups=ring(size, r), verify_same_row=False, pad_token_id=0, **kwargs)
        for r in range(size)
    ]


def test_document_boundaries_by_hand():
    assert document_starts(POS[0]).tolist() == [True, False, False, True, False, False, False, True, False]
    assert cu_seqlens_from_position_ids(POS) == [0, 3, 7, 9]
    # Restarts that do not go back to 0 still start a document (the positions do not continue).
    assert cu_seqlens_from_position_ids(torch.tensor([0, 1, 5, 6, 0])) == [0, 2, 4, 5]
    assert shifted_labels(LABELS[0], POS[0]).tolist() == SHIFTED[:9]


@pytest.mark.parametrize("mask_kind", ["labels", "loss_mask"])
def test_four_ranks_slices_padding_and_shifted_labels(mask_kind):
    contiguous = SequenceParallelConfig(ring_placement="contiguous")
    if mask_kind == "labels":
        parts = shards(4, labels=LABELS, extras={"weight": torch.arange(1.0, 10.0)[None]}, config=contiguous)
    else:
        parts = shards(4, loss_mask=LABELS != -100, extras={"weight": torch.arange(1.0, 10.0)[None]}, config=contiguous)
    assert [p.input_ids.shape for p in parts] == [torch.Size([1, 3])] * 4
    assert torch.cat([p.input_ids for p in parts], 1).tolist() == [IDS[0].tolist() + [0, 0, 0]]
    assert torch.cat([p.position_ids for p in parts], 1).tolist() == [PADDED_POS]
    assert torch.cat([p.shift_labels for p in parts], 1).tolist() == [SHIFTED]
    assert torch.cat([p.document_ids for p in parts], 1).tolist() == [DOC_IDS]
    assert torch.cat([p.extras["weight"] for p in parts], 1).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]]
    metas = [p.attention_meta for p in parts]
    assert all(m.cu_seqlens == (0, 3, 7, 9, 12) and m.total_length == 12 and m.unpadded_length == 9 for m in metas)
    assert [(m.local_start, m.local_length, m.rank, m.group_size) for m in metas] == [
        (0, 3, 0, 4),
        (3, 3, 1, 4),
        (6, 3, 2, 4),
        (9, 3, 3, 4),
    ]
    # Keys a rank needs start at the document of its first token: rank 2 starts inside document 1 (tokens 3..6).
    assert [m.kv_start for m in metas] == [0, 3, 3, 9]
    assert metas[0].document_last_token_indices() == [2, 6, 8]
    cu_q, cu_k, max_q, max_k = metas[2].varlen_layout(torch.device("cpu"))
    assert (cu_q.tolist(), cu_k.tolist(), max_q, max_k) == ([0, 1, 3], [0, 4, 6], 2, 4)
    inputs = parts[1].model_inputs()
    assert inputs[RING_META_KWARG] is metas[1] and inputs["use_cache"] is False
    assert inputs["input_ids"].tolist() == [[20, 21, 22]]


def test_zigzag_placement_by_hand():
    """9 tokens on 4 ranks are padded to 16 (a multiple of 2 x 4), cut into 8 chunks of 2, and rank r holds chunks r
    and 7 - r; each piece is attended with its own metadata."""
    parts = shards(4, labels=LABELS, config=SequenceParallelConfig(ring_placement="zigzag"))
    padded = IDS[0].tolist() + [0] * 7
    chunks = [padded[2 * i : 2 * i + 2] for i in range(8)]
    assert [p.input_ids[0].tolist() for p in parts] == [chunks[r] + chunks[7 - r] for r in range(4)]
    metas = [p.attention_meta for p in parts]
    assert all(m.placement == "zigzag" and m.total_length == 16 and m.cu_seqlens == (0, 3, 7, 9, 16) for m in metas)
    assert [m.local_ranges() for m in metas] == [[(0, 2), (14, 16)], [(2, 4), (12, 14)], [(4, 6), (10, 12)],
                                                  [(6, 10)]]  # fmt: skip  (rank 3's chunks 3 and 4 are one piece)
    assert [[(o, p.local_start, p.local_length, p.kv_start) for o, p in m.pieces()] for m in metas][1] == [
        (0, 2, 2, 0),  # tokens 2..3: document 0 starts at 0
        (2, 12, 2, 9),  # tokens 12..13: in the padding document (9..15)
    ]
    # Global positions back to local indices (-1: another rank's), and the gathered row back in order.
    assert metas[2].local_positions(torch.tensor([4, 5, 6, 10, 11, 12])).tolist() == [0, 1, -1, 2, 3, -1]
    gathered = torch.cat([p.input_ids[0] for p in parts])
    assert metas[0].to_global_order(gathered).tolist() == padded
    assert metas[0].to_rank_major_order(torch.tensor(padded)).tolist() == gathered.tolist()
    # A rank's key span (rank 1's: 0..14) of per-token values written straight into the rank-major order: as the
    # whole row, zero elsewhere, reordered (what the ring's key/value gradients are reduce-scattered as).
    span = metas[1].key_span()
    values = torch.arange(1.0, 1.0 + 2 * (span[1] - span[0])).reshape(-1, 2)
    row = torch.zeros(16, 2)
    row[span[0] : span[1]] = values
    assert span == (0, 14)
    assert torch.equal(metas[1].span_in_rank_major_order(values, span), metas[1].to_rank_major_order(row))
    shifted = metas[0].to_global_order(torch.cat([p.shift_labels[0] for p in parts]))
    assert shifted.tolist() == SHIFTED[:9] + [-100] * 7


def test_balanced_placement_by_hand():
    """Chunks go, heaviest causal work first, to the least-loaded rank with room. One document: the zigzag placement.
    Documents of 12 and 4 tokens on 2 ranks, chunks of 4 (works 10, 26, 42 | 10): zigzag gives 20 vs 68, the balanced
    owners 52 vs 36; chunks of 2 (works 3, 7, 11, 15, 19, 23 | 3, 7): 44 vs 44."""
    from trl_longrm.sequence_parallel.sharding import balanced_chunks_per_rank, chunk_owners, chunk_ranges, span_work

    assert chunk_owners("balanced", 8, 4, cu_seqlens=(0, 16)) == chunk_owners("zigzag", 8, 4)
    cu = (0, 12, 16)
    assert [span_work(cu, (0, 0), 4 * c, 4 * c + 4) for c in range(4)] == [10, 26, 42, 10]
    assert chunk_owners("zigzag", 4, 2) == [[0, 3], [1, 2]]
    assert chunk_owners("balanced", 4, 2, cu_seqlens=cu) == [[2, 3], [0, 1]]
    owners = chunk_owners("balanced", 8, 2, cu_seqlens=cu)
    assert owners == [[0, 1, 2, 5], [3, 4, 6, 7]]
    assert [chunk_ranges(o, 2) for o in owners] == [[(0, 6), (10, 12)], [(6, 10), (12, 16)]]  # adjacent chunks merge
    # The fewest chunks per rank that balance within 5%, never chunks under MIN_BALANCED_CHUNK tokens beyond the first
    # choice: the same row 64 times longer takes 4 per rank, the short one keeps 2.
    assert balanced_chunks_per_rank([0, 12 * 64, 16 * 64], None, 16 * 64, 2) == 4
    assert balanced_chunks_per_rank([0, 12, 16], None, 16, 2) == 2
    assert balanced_chunks_per_rank([0, 16 * 64], None, 16 * 64, 2) == 2  # one document: zigzag is exact
    # Through shard_packed_row: the ranks' pieces tile the row, and the metadata's work is the hand count.
    ids = torch.arange(16 * 64)[None]
    pos = torch.cat([torch.arange(12 * 64), torch.arange(4 * 64)])[None]
    metas = [shard_packed_row(ids, pos, groups=ring(2, r), verify_same_row=False).attention_meta for r in range(2)]
    assert all(m.placement == "balanced" and m.num_chunks == 8 for m in metas)
    assert sorted(r for m in metas for r in m.local_ranges()) == [(0, 384), (384, 640), (640, 768), (768, 1024)]
    from trl_longrm.sequence_parallel.sharding import attention_work

    work = [attention_work(m) for m in metas]
    assert sum(work) == 768 * 769 // 2 + 256 * 257 // 2 and max(work) / (sum(work) / 2) <= 1.05


def test_config_travels_in_metadata():
    config = SequenceParallelConfig(ring_head_stride=2, ring_attn_backend="torch", ring_query_chunk_size=7,
                                    ring_placement="contiguous")  # fmt: skip
    meta = shard_packed_row(IDS, POS, groups=ring(2, 1), verify_same_row=False, config=config).attention_meta
    assert (meta.ring_head_stride, meta.backend, meta.query_chunk_size) == (2, "torch", 7)
    # 9 tokens on 2 ranks: one padding token.
    assert (meta.total_length, meta.local_start, meta.num_padding) == (10, 5, 1)


def test_no_ring_keeps_the_whole_row():
    shard = shard_packed_row(IDS, POS, LABELS)
    assert shard.input_ids.tolist() == IDS.tolist() and shard.shift_labels.tolist() == [SHIFTED[:9]]
    meta = shard.attention_meta
    assert meta.group is None and (meta.local_start, meta.local_length, meta.total_length) == (0, 9, 9)
    assert packed_row_metadata(POS).cu_seqlens == meta.cu_seqlens == (0, 3, 7, 9)
    # Without labels every next token of the same document is a target; without positions the row is one document.
    assert shard_packed_row(IDS, POS).shift_labels.tolist() == [[11, 12, -100, 21, 22, 23, -100, 31, -100]]
    assert shard_packed_row(IDS).shift_labels.tolist() == [IDS[0, 1:].tolist() + [-100]]


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"input_ids": IDS.repeat(2, 1)}, ValueError, "my_data: `input_ids` has batch size 2"),
        ({"position_ids": POS[:, :5]}, ValueError, "my_data: `position_ids` has 5 tokens"),
        ({"labels": LABELS[:, :4]}, ValueError, "my_data: `labels` has 4 tokens"),
        ({"labels": LABELS, "loss_mask": LABELS != -100}, ValueError, "either `labels` or `loss_mask`"),
        ({"extras": {"w": torch.ones(1, 3)}}, ValueError, r"my_data: `extras\['w'\]` has 3 tokens"),
        ({"position_ids": -POS}, ValueError, "negative"),
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long), "position_ids": None}, ValueError, "empty"),
        ({"input_ids": [1, 2, 3], "position_ids": None}, TypeError, "must be a torch.Tensor"),
    ],
)
def test_bad_rows_fail_clearly(kwargs, error, match):
    args = {"input_ids": IDS, "position_ids": POS, **kwargs}
    with pytest.raises(error, match=match):
        shard_packed_row(args.pop("input_ids"), args.pop("position_ids"), source="my_data", **args)


def test_metadata_rejects_inconsistent_geometry():
    with pytest.raises(ValueError, match="must start at 0 and end at total_length"):
        RingAttentionMetadata(cu_seqlens=(0, 5), total_length=6, unpadded_length=6, local_start=0, local_length=6)
    with pytest.raises(ValueError, match="padded to a multiple of the ring size"):
        RingAttentionMetadata(
            cu_seqlens=(0, 7), total_length=7, unpadded_length=7, local_start=0, local_length=3, group_size=2
        )


def test_attention_work_sums_to_every_causal_pair_over_the_ring():
    """`attention_work` (what bench/sp_balance.py spreads over ranks) against a hand count: over the ring's ranks the
    work adds up to every document's causal pairs (plus each response's prefix pairs in a shared row), and the
    contiguous placement of one document gives the last of P ranks (2P-1)/P of the mean."""
    import importlib.util
    from pathlib import Path

    from trl_longrm.sequence_parallel.sharding import attention_work

    spec = importlib.util.spec_from_file_location("sp_balance", Path(__file__).parents[1] / "bench" / "sp_balance.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lengths = [37, 5, 90, 1]
    for placement, pad in [("zigzag", -sum(lengths) % 8), ("contiguous", -sum(lengths) % 4)]:
        # The padding to a multiple of the placement's chunk count is attended as a document of its own.
        assert sum(bench.rank_work(lengths, 4, placement=placement)) == sum(n * (n + 1) // 2 for n in [*lengths, pad])
    shared, parents = [40, 7, 9], [-1, 0, 0]
    pairs = 40 * 41 // 2 + sum(n * (n + 1) // 2 + n * 40 for n in (7, 9))
    assert sum(bench.rank_work(shared, 4, parents)) == pairs
    assert attention_work(packed_row_metadata(torch.tensor([0, 1, 2, 0, 1]))) == 9
    # The contiguous placement gives the last of P ranks (2P - 1) / P of the mean on one document; the zigzag one
    # balances it but not a packed row of unequal documents; the balanced one (the trainers' default) balances all
    # three, and a shared-prefix row.
    assert bench.balance(bench.rank_work([4096], 8, placement="contiguous")) == pytest.approx(15 / 8, rel=1e-3)
    assert bench.balance(bench.rank_work([4096], 8, placement="zigzag")) == pytest.approx(1.0)
    packed = [2048, 1024, 512, 256, 256]
    assert bench.balance(bench.rank_work(packed, 8, placement="zigzag")) > 1.4
    assert bench.balance(bench.rank_work([4096], 8)) == pytest.approx(1.0)
    assert bench.balance(bench.rank_work(packed, 8)) <= 1.05
    assert bench.balance(bench.rank_work([4096 - 4 * 256] + [256] * 4, 8, [-1, 0, 0, 0, 0])) <= 1.10
