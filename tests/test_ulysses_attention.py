"""Ulysses (all-to-all over heads) and hybrid (Ulysses groups x a ring) sequence parallelism, the attention alone:
output and q/k/v gradients of every rank's tokens equal to one process attending the whole row (fp32), on packed rows
and shared-prefix rows whose documents cross the ranks, with grouped-query attention (key/value heads replicated when
the Ulysses group has more ranks than key/value heads)."""

import pytest
import torch
from test_sequence_parallel_attention import MODULE, PRELOAD, positions  # noqa: E402

from trl_longrm.sequence_parallel import (
    SequenceParallelConfig,
    init_sequence_parallel_groups,
    ring_attention_forward,
    shard_packed_row,
)
from trl_longrm.sequence_parallel.attention import ulysses_kv_heads
from trl_longrm.sequence_parallel.config import check_sequence_parallel_mode
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks
from trl_longrm.sequence_parallel.sharding import shared_row_metadata, split_ranges
from trl_longrm.sequence_parallel.validation import check_ulysses_heads


# (query heads, key/value heads) per Ulysses size: an equal split of the KV heads, and KV heads replicated.
HEADS = {2: [(4, 2), (2, 2), (6, 2)], 4: [(4, 4), (8, 2), (4, 1)]}
# Document lengths of a packed row, and a shared-prefix row: (segment lengths, parents) = a 23-token prompt and
# three responses to it, then a second group (prompt of 9, responses of 4 and 6).
PACKED = [5, 13, 1, 9, 3]
SHARED = ([23, 3, 7, 2, 9, 4, 6], [-1, 0, 0, 0, -1, 4, 4])


def _one_process(q, k, v, grad_out, meta, scaling):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    args = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, tokens, D]
    out, _ = ring_attention_forward(MODULE, *args, None, scaling=scaling, ring_attn_meta=meta)
    out.backward(grad_out[None])
    return out[0].detach(), q.grad, k.grad, v.grad


def _check(rank, world_size, mode, ulysses_size):
    size = world_size
    groups = init_sequence_parallel_groups(size, mode=mode, ulysses_size=ulysses_size)
    assert groups.ulysses_size == (ulysses_size or size)
    scaling = 0.3
    for num_heads, num_kv_heads in HEADS[groups.ulysses_size]:
        for layout in ("packed", "shared"):
            if layout == "packed":
                length = sum(PACKED)
                extra = dict(position_ids=positions(PACKED)[None])
            else:
                length = sum(SHARED[0])
                extra = dict(segment_lengths=torch.tensor(SHARED[0]), segment_parents=torch.tensor(SHARED[1]))
            for placement in ("balanced", "contiguous"):
                config = SequenceParallelConfig(
                    sequence_parallel_size=size, sequence_parallel_mode=mode, ulysses_size=ulysses_size,
                    ring_placement=placement, ring_query_chunk_size=4,
                )  # fmt: skip
                shard = shard_packed_row(torch.zeros(1, length, dtype=torch.long), groups=groups, config=config,
                                         **extra)  # fmt: skip
                meta = shard.attention_meta
                total = meta.total_length
                gen = torch.Generator().manual_seed(num_heads * 7 + num_kv_heads)
                q = torch.randn(total, num_heads, 8, generator=gen, dtype=torch.float32)
                k = torch.randn(total, num_kv_heads, 8, generator=gen, dtype=torch.float32)
                v = torch.randn(total, num_kv_heads, 8, generator=gen, dtype=torch.float32)
                grad_out = torch.randn(total, num_heads, 8, generator=gen, dtype=torch.float32)
                grad_out[length:] = 0  # the padding's output is never used
                # One process: the whole padded row (padding its own document, as the shards see it).
                whole = shard_packed_row(torch.zeros(1, length, dtype=torch.long), config=config, **extra)
                assert whole.attention_meta.group is None
                if whole.attention_meta.total_length != total:  # pad the one-process row as the shards are padded
                    cu = list(meta.cu_seqlens)
                    if layout == "shared":
                        whole_meta = shared_row_metadata(torch.tensor(cu[1:]) - torch.tensor(cu[:-1]),
                                                         torch.tensor(meta.segment_parents or [-1] * (len(cu) - 1)))  # fmt: skip
                    else:
                        pos = torch.cat([positions(PACKED), torch.arange(total - length)])
                        whole_meta = shard_packed_row(torch.zeros(1, total, dtype=torch.long), pos[None],
                                                      config=config).attention_meta  # fmt: skip
                else:
                    whole_meta = whole.attention_meta
                ref = _one_process(q, k, v, grad_out, whole_meta, scaling)
                index = meta.global_index()
                ql, kl, vl = (t[None, index].clone().requires_grad_() for t in (q, k, v))
                args = (t.transpose(1, 2) for t in (ql, kl, vl))
                out, _ = ring_attention_forward(MODULE, *args, None, scaling=scaling, ring_attn_meta=meta)
                out.backward(grad_out[index][None])
                label = f"rank {rank} {mode} u={groups.ulysses_size} heads {num_heads}/{num_kv_heads} {layout} {placement}"
                real = index < length
                for name, got, expected in [
                    ("out", out[0].detach(), ref[0][index]),
                    ("dq", ql.grad[0], ref[1][index]),
                    ("dk", kl.grad[0], ref[2][index]),
                    ("dv", vl.grad[0], ref[3][index]),
                ]:
                    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5,
                                               msg=lambda m, n=name, lb=label: f"{lb} {n}: {m}")  # fmt: skip


def _worker(rank, world_size, runs):
    for mode, ulysses_size in runs:
        _check(rank, world_size, mode, ulysses_size)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,runs",
    [(2, [("ulysses", None)]), (4, [("ulysses", None), ("hybrid", 2)])],
    ids=["ulysses2", "ulysses4+hybrid2x2"],
)
def test_ulysses_and_hybrid_attention_equal_one_process(world_size, runs):
    run_on_gloo_ranks(_worker, world_size, runs, preload=PRELOAD)


def test_ulysses_kv_heads_replicate_when_fewer_than_ranks():
    assert ulysses_kv_heads(8, 4, 2) == [[0, 1], [2, 3]]
    assert ulysses_kv_heads(8, 2, 4) == [[0], [0], [1], [1]]
    assert ulysses_kv_heads(4, 1, 4) == [[0], [0], [0], [0]]


def test_split_ranges_cuts_a_place_into_equal_consecutive_slices():
    assert split_ranges([(0, 4), (12, 16)], 4) == [[(0, 2)], [(2, 4)], [(12, 14)], [(14, 16)]]
    assert split_ranges([(0, 3), (9, 12)], 2) == [[(0, 3)], [(9, 12)]]
    assert split_ranges([(0, 4), (8, 10)], 3) == [[(0, 2)], [(2, 4)], [(8, 10)]]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,size,fragment",
    [(6, 2, 4, "6 attention heads"), (12, 3, 2, "3 key/value heads"), (4, 4, 8, "4 attention heads")],
)
def test_heads_that_do_not_split_are_an_error_naming_the_sizes_that_work(num_heads, num_kv_heads, size, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        check_ulysses_heads(num_heads, num_kv_heads, size, "Model")
    assert "ulysses" in str(info.value).lower() and "sizes that work" in str(info.value)
    check_ulysses_heads(8, 2, 4, "Model")  # replicated KV heads: fine


@pytest.mark.parametrize(
    "mode,size,ulysses_size,fragment",
    [
        ("ulysses", 4, 2, "sequence_parallel_mode='hybrid'"),
        ("ring", 4, 2, "does not use it"),
        ("hybrid", 4, None, "needs ulysses_size"),
        ("hybrid", 4, 4, "possible values: [2]"),
        ("hybrid", 6, 4, "possible values: [2, 3]"),
        ("sideways", 2, None, "must be one of"),
    ],
)
def test_mode_and_ulysses_size_must_agree(mode, size, ulysses_size, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        check_sequence_parallel_mode(mode, size, ulysses_size)
    with pytest.raises(ValueError):
        SequenceParallelConfig(sequence_parallel_size=size, sequence_parallel_mode=mode, ulysses_size=ulysses_size)


def test_a_model_whose_heads_do_not_split_is_refused_before_training():
    from trl_longrm.sequence_parallel import validate_ring_attention_model
    from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model

    model = build_tiny_model("qwen3", "seq-cls", build_chat_tokenizer())  # 4 query / 2 key-value heads
    config = SequenceParallelConfig(sequence_parallel_size=8, sequence_parallel_mode="ulysses")
    with pytest.raises(ValueError, match=r"4 attention heads do not divide by 8.*sizes that work .*: \[2, 4\]"):
        validate_ring_attention_model(model, config)
    hybrid = SequenceParallelConfig(sequence_parallel_size=8, sequence_parallel_mode="hybrid", ulysses_size=4)
    validate_ring_attention_model(model, hybrid)  # Ulysses of 4 (key/value heads replicated) x a ring of 2
