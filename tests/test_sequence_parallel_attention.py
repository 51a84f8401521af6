"""The ring attention function alone against an independent reference: per-document causal SDPA with the key/value
heads repeated for grouped-query attention, outputs and q/k/v gradients."""

import contextlib
import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from trl_longrm.sequence_parallel import (
    SequenceParallelConfig,
    init_sequence_parallel_groups,
    packed_row_metadata,
    ring_attention_forward,
    shard_packed_row,
    sharding,
)
from trl_longrm.sequence_parallel.kernels import TorchBlockKernel, VarlenKernel, resolve_kernel
from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks
from trl_longrm.sequence_parallel.sharding import RingAttentionMetadata


MODULE = types.SimpleNamespace(is_causal=True)
PRELOAD = ("trl_longrm.testing_utils",)  # the fork server imports it once for all multi-process tests
# (query heads, key/value heads, document lengths): GQA and MHA, documents crossing slice boundaries, total lengths
# that are not multiples of 2 or 4, a one-token document.
CASES = [(4, 2, [5, 13, 1, 9, 3]), (6, 3, [17, 4, 6]), (2, 2, [2, 21, 8])]


def strides(num_kv_heads):
    return [s for s in range(1, num_kv_heads + 1) if num_kv_heads % s == 0] + [None]


def positions(doc_lengths):
    return torch.cat([torch.arange(n) for n in doc_lengths])


def reference_attention(q, k, v, doc_lengths, scaling):
    """q `[H, L, D]`, k/v `[Hkv, L, D]` -> `[L, H, D]`: each document attends causally to itself only."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    outs, start = [], 0
    for n in doc_lengths:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, sl], k[:, sl], v[:, sl], is_causal=True, scale=scaling))
        start += n
    return torch.cat(outs, dim=1).transpose(0, 1)


def random_problem(num_heads, num_kv_heads, length, seed, head_dim=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_heads, length, head_dim, generator=gen)
    k = torch.randn(num_kv_heads, length, head_dim, generator=gen)
    v = torch.randn(num_kv_heads, length, head_dim, generator=gen)
    grad_out = torch.randn(length, num_heads, head_dim, generator=gen)
    return q, k, v, grad_out


def reference_with_grads(q, k, v, grad_out, doc_lengths, scaling):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, doc_lengths, scaling)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("num_heads,num_kv_heads,doc_lengths", CASES)
@pytest.mark.parametrize("chunk", [4, 1024])
def test_packed_single_process_matches_reference(num_heads, num_kv_heads, doc_lengths, chunk):
    """meta=None: documents read from position_ids; a batch of two packed rows with different documents."""
    rows = [doc_lengths, list(reversed(doc_lengths))]
    length, scaling = sum(doc_lengths), 0.3
    problems = [random_problem(num_heads, num_kv_heads, length, seed) for seed in (0, 1)]
    q, k, v = (torch.stack([p[i] for p in problems]).requires_grad_() for i in range(3))
    grad_out = torch.stack([p[3] for p in problems])
    pos = torch.stack([positions(r) for r in rows])
    # meta=None uses the default config (query chunk 1024); a per-row metadata exercises small query blocks.
    if chunk == 1024:
        out, weights = ring_attention_forward(MODULE, q, k, v, None, scaling=scaling, position_ids=pos)
        assert weights is None
    else:
        config = SequenceParallelConfig(ring_query_chunk_size=chunk, ring_head_stride=None)
        out = torch.cat(
            [
                ring_attention_forward(
                    MODULE,
                    q[b : b + 1],
                    k[b : b + 1],
                    v[b : b + 1],
                    None,
                    scaling=scaling,
                    ring_attn_meta=packed_row_metadata(pos[b], config),
                )[0]
                for b in range(2)
            ]
        )
    out.backward(grad_out)
    for b, row in enumerate(rows):
        ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(*problems[b], row, scaling)
        torch.testing.assert_close(out[b].detach(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q.grad[b], ref_dq, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k.grad[b], ref_dk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v.grad[b], ref_dv, atol=1e-5, rtol=1e-5)


def test_single_process_is_not_plain_causal():
    """Guard against a vacuous reference: document masking changes the result compared with one causal sequence."""
    q, k, v, _ = random_problem(4, 2, 12, seed=3)
    pos = positions([5, 7]).unsqueeze(0)
    out, _ = ring_attention_forward(MODULE, q[None], k[None], v[None], None, scaling=0.3, position_ids=pos)
    causal = reference_attention(q, k, v, [12], 0.3)
    torch.testing.assert_close(out[0, :5], causal[:5])
    assert (out[0, 5:] - causal[5:]).abs().max() > 1e-2


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """flash-attn semantics on CPU: per document, query i of nq sees key j of nk iff j <= i + nk - nq."""
    outs = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        nq, nk = qi.shape[0], ki.shape[0]
        assert nq <= max_q and nk <= max_k
        mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
        out = F.scaled_dot_product_attention(
            qi.transpose(0, 1),
            ki.transpose(0, 1),
            vi.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def emulated_ring(kernel, q, k, v, grad_out, doc_lengths, group_size, chunk, scaling):
    """Run a kernel rank by rank in one process, as the ring does (keys [kv_start, local_end) of the padded row),
    summing the key/value gradients of all ranks like the reduce-scatter."""
    length = sum(doc_lengths)
    pad = -length % group_size
    total = length + pad
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # [H, total, D]
    grad_out = F.pad(grad_out, (0, 0, 0, 0, 0, pad))
    cu = [0]
    for n in doc_lengths + ([pad] if pad else []):
        cu.append(cu[-1] + n)
    local = total // group_size
    out, dq = q.new_zeros(total, q.shape[0], q.shape[2]), q.new_zeros(total, q.shape[0], q.shape[2])
    dk, dv = k.new_zeros(total, k.shape[0], k.shape[2]), k.new_zeros(total, k.shape[0], k.shape[2])
    for rank in range(group_size):
        meta = RingAttentionMetadata(
            cu_seqlens=tuple(cu),
            total_length=total,
            unpadded_length=length,
            local_start=rank * local,
            local_length=local,
            group_size=group_size,
            rank=rank,
            query_chunk_size=chunk,
        )
        lo, hi, ks = rank * local, (rank + 1) * local, meta.kv_start
        ql, kr, vr = q[:, lo:hi].transpose(0, 1), k[:, ks:hi].transpose(0, 1), v[:, ks:hi].transpose(0, 1)
        out[lo:hi] = kernel.forward(ql, kr, vr, meta, scaling)
        g_q, g_k, g_v = kernel.backward(ql, kr, vr, grad_out[lo:hi], meta, scaling)
        dq[lo:hi] = g_q
        dk[ks:hi] += g_k
        dv[ks:hi] += g_v
    return out[:length], dq[:length], dk[:length], dv[:length]


def test_single_process_varlen_kernel_runs_under_plain_autograd(monkeypatch):
    """On one process a varlen kernel (flash-attn, torch's varlen_attn on CUDA; a pure-torch stand-in here) is called
    under plain autograd, all heads at once: no ring autograd function, whose backward would recompute the attention
    head chunk by head chunk with nothing to gather. Output and gradients as the reference."""
    import trl_longrm.sequence_parallel.attention as attention

    calls = []

    def varlen(*args):
        calls.append(args[0].shape[1])  # query heads of the call
        return reference_varlen(*args)

    def no_ring(*args):
        raise AssertionError("the ring autograd function is not needed on one process")

    monkeypatch.setattr(attention, "resolve_kernel", lambda *args: VarlenKernel("stand_in", varlen))
    monkeypatch.setattr(attention._RingAttention, "apply", no_ring)
    doc_lengths, scaling = [5, 9, 3], 0.3
    q, k, v, grad_out = random_problem(4, 2, sum(doc_lengths), seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    meta = packed_row_metadata(positions(doc_lengths), SequenceParallelConfig(ring_head_stride=1))
    out, _ = ring_attention_forward(MODULE, *(t[None] for t in leaves), None, scaling=scaling, ring_attn_meta=meta)
    out[0].backward(grad_out)
    assert calls == [4]  # one call with every head, although ring_head_stride=1
    ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, grad_out, doc_lengths, scaling)
    torch.testing.assert_close(out[0].detach(), ref_out, atol=1e-5, rtol=1e-5)
    for got, expected in zip((t.grad for t in leaves), (ref_dq, ref_dk, ref_dv)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,doc_lengths", CASES)
@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize(
    "kernel", [TorchBlockKernel(), VarlenKernel("reference_varlen", reference_varlen)], ids=["torch", "varlen"]
)
def test_kernels_on_emulated_ring_match_reference(kernel, group_size, num_heads, num_kv_heads, doc_lengths):
    """Kernel-level geometry (slice offsets, key ranges, varlen boundaries with bottom-right causal alignment)."""
    length, scaling = sum(doc_lengths), 0.25
    q, k, v, grad_out = random_problem(num_heads, num_kv_heads, length, seed=group_size)
    expected = reference_with_grads(q, k, v, grad_out, doc_lengths, scaling)
    got = emulated_ring(kernel, q, k, v, grad_out, doc_lengths, group_size, chunk=3, scaling=scaling)
    expected = (expected[0], *(grad.transpose(0, 1) for grad in expected[1:]))  # token-major like the kernels
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "auto", "flash_attn", "cudnn"])
@pytest.mark.parametrize("group_size", [1, 4])
def test_cuda_kernels_on_emulated_ring(backend, group_size):
    """The CUDA kernels (torch varlen_attn / cuDNN / flash-attn in bf16) with the same ring geometry, against the fp32
    reference (cuDNN given every sequence of 32+ queries). Runs only where a GPU is present."""
    from trl_longrm.sequence_parallel import is_flash_attn_available
    from trl_longrm.sequence_parallel.kernels import TorchCudnnOps, TorchVarlenOps, varlen_function_of

    if backend == "flash_attn" and not is_flash_attn_available():
        pytest.skip("flash-attn is not installed")
    num_heads, num_kv_heads, doc_lengths = 8, 2, [37, 150, 3, 66]
    length, scaling = sum(doc_lengths), 0.125
    q, k, v, grad_out = random_problem(num_heads, num_kv_heads, length, seed=5, head_dim=64)
    q, k, v, grad_out = (t.bfloat16().float() for t in (q, k, v, grad_out))  # the reference sees the same inputs
    expected = reference_with_grads(q, k, v, grad_out, doc_lengths, scaling)
    expected = (expected[0], *(grad.transpose(0, 1) for grad in expected[1:]))
    kernel = resolve_kernel(backend, torch.device("cuda"), torch.bfloat16)
    if backend == "cudnn":
        ops = TorchCudnnOps(TorchVarlenOps.load(), min_tokens=32)
        kernel = VarlenKernel(ops.name, varlen_function_of(ops), ops)
    cuda = [t.cuda().bfloat16() for t in (q, k, v, grad_out)]
    got = emulated_ring(kernel, *cuda, doc_lengths, group_size, chunk=64, scaling=scaling)
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(
            g.float().cpu(), e, atol=3e-2, rtol=3e-2, msg=lambda m, name=name: f"{kernel.name} {name}: {m}"
        )


def test_auto_backend_on_cpu_is_torch():
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32).name == "torch"
    assert resolve_kernel("torch", torch.device("cpu"), torch.bfloat16).name == "torch"


# ----------------------------------------------------------------------------------------------------------------
# Multi-process: the real collectives on gloo.


def _ring_attention_worker(rank, world_size, sequence_parallel_sizes):
    for sequence_parallel_size in sequence_parallel_sizes:
        _check_ring_attention(rank, world_size, sequence_parallel_size)


def _check_ring_attention(rank, world_size, sequence_parallel_size):
    groups = init_sequence_parallel_groups(sequence_parallel_size)
    scaling = 0.3
    for case_index, (num_heads, num_kv_heads, doc_lengths) in enumerate(CASES):
        # Different rings get different rows (data parallelism): rotate the documents and change the seed.
        shift = groups.data_parallel_rank % len(doc_lengths)
        docs = doc_lengths[shift:] + doc_lengths[:shift]
        length = sum(docs)
        q, k, v, grad_out = random_problem(num_heads, num_kv_heads, length, seed=10 * case_index + shift)
        ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, grad_out, docs, scaling)
        # Small query blocks for every stride (the default, balanced placement); one run with a block longer than the
        # slice; the zigzag and contiguous placements; and the balanced one cut as finely as it goes (8 chunks per
        # rank of 1 or 2 tokens: many pieces per rank, documents crossing them).
        runs = [(s, 4, "balanced") for s in strides(num_kv_heads)] + [
            (None, 1024, "balanced"), (None, 4, "zigzag"), (None, 4, "contiguous"), (None, 4, "balanced_fine")
        ]  # fmt: skip
        for stride, chunk, placement in runs:
            config = SequenceParallelConfig(
                sequence_parallel_size=sequence_parallel_size, ring_head_stride=stride, ring_query_chunk_size=chunk,
                ring_placement=placement.removesuffix("_fine"),
            )  # fmt: skip
            with contextlib.ExitStack() as stack:
                if placement == "balanced_fine":
                    stack.enter_context(mock.patch.object(sharding, "BALANCED_CHUNKS_PER_RANK", (8,)))
                    stack.enter_context(mock.patch.object(sharding, "MIN_BALANCED_CHUNK", 1))
                shard = shard_packed_row(
                    torch.zeros(1, length, dtype=torch.long), positions(docs)[None], groups=groups, config=config
                )
            if placement == "balanced_fine":
                assert shard.attention_meta.num_chunks == 8 * sequence_parallel_size
            meta = shard.attention_meta
            pad = meta.num_padding
            index = meta.global_index()  # this rank's tokens by the placement (several pieces)
            real = index < length  # real tokens (not padding) among them
            # Padding gets random q/k/v: it must not leak into real tokens.
            noise = torch.Generator().manual_seed(99 + rank)
            qp, kp, vp = (
                torch.cat([t, torch.randn(t.shape[0], pad, t.shape[2], generator=noise)], dim=1) for t in (q, k, v)
            )
            ql, kl, vl = (t[None, :, index].clone().requires_grad_() for t in (qp, kp, vp))
            dout = torch.zeros(index.numel(), num_heads, q.shape[2])
            dout[real] = grad_out[index[real]]
            out, _ = ring_attention_forward(MODULE, ql, kl, vl, None, scaling=scaling, ring_attn_meta=meta)
            out.backward(dout[None])
            label = (
                f"rank {rank}/{world_size} sp={sequence_parallel_size} case {case_index} stride {stride} {placement}"
            )
            mine = index[real]
            checks = [
                ("out", out[0, real].detach(), ref_out[mine]),
                ("dq", ql.grad[0][:, real], ref_dq[:, mine]),
                ("dk", kl.grad[0][:, real], ref_dk[:, mine]),
                ("dv", vl.grad[0][:, real], ref_dv[:, mine]),
            ]
            for name, got, expected in checks:
                torch.testing.assert_close(
                    got, expected, atol=1e-5, rtol=1e-5, msg=lambda m, n=name, lb=label: f"{lb} {n}: {m}"
                )


@pytest.mark.slow
@pytest.mark.parametrize("world_size,sequence_parallel_sizes", [(2, [2]), (4, [4, 2])])
def test_ring_attention_on_gloo_matches_reference(world_size, sequence_parallel_sizes):
    """2- and 4-process rings, and two rings of 2 holding different rows (data x sequence parallel): every head
    stride, GQA, padding."""
    run_on_gloo_ranks(_ring_attention_worker, world_size, sequence_parallel_sizes, preload=PRELOAD)


def _schedule_worker(rank, world_size, result_path):
    """Record, on a ring of 2 with 4 key/value heads gathered one at a time, the order of the collectives (issued /
    waited for) and of the kernel calls, with the real gloo collectives and PyTorch's fused CPU attention."""
    import json

    from trl_longrm.sequence_parallel import attention
    from trl_longrm.sequence_parallel.kernels import TorchCpuFlashOps

    log = []

    class Recorded:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            log.append(self.name.lower())
            return self.work.wait()

    def recording(start, name):
        def wrapper(*args, **kwargs):
            log.append(name)
            out, work = start(*args, **kwargs)
            return out, Recorded(work, name)

        return wrapper

    def kernel_call(method, name):
        def wrapper(*args, **kwargs):
            log.append(name)
            return method(*args, **kwargs)

        return wrapper

    groups = init_sequence_parallel_groups(world_size)
    doc_lengths, scaling = [23, 9], 0.3
    length = sum(doc_lengths)
    q, k, v, grad_out = random_problem(8, 4, length, seed=3)
    config = SequenceParallelConfig(sequence_parallel_size=world_size, ring_head_stride=1)
    shard = shard_packed_row(torch.zeros(1, length, dtype=torch.long), positions(doc_lengths)[None], groups=groups,
                             config=config)  # fmt: skip
    meta = shard.attention_meta
    index = meta.global_index()
    real = index < length
    local = [torch.cat([t, t.new_zeros(t.shape[0], meta.num_padding, t.shape[2])], 1)[:, index] for t in (q, k, v)]
    leaves = [t[None].clone().requires_grad_() for t in local]
    dout = torch.zeros(index.numel(), 8, q.shape[2])
    dout[real] = grad_out[index[real]]
    with contextlib.ExitStack() as stack:
        patch = lambda *a: stack.enter_context(mock.patch.object(*a))  # noqa: E731
        patch(attention, "start_all_gather_dim0", recording(attention.start_all_gather_dim0, "G"))
        patch(attention, "start_reduce_scatter_dim0", recording(attention.start_reduce_scatter_dim0, "S"))
        patch(TorchCpuFlashOps, "forward", kernel_call(TorchCpuFlashOps.forward, "F"))
        patch(TorchCpuFlashOps, "backward", kernel_call(TorchCpuFlashOps.backward, "B"))
        out, _ = ring_attention_forward(MODULE, *leaves, None, scaling=scaling, ring_attn_meta=meta)
        forward_log = list(log)
        log.clear()
        out.backward(dout[None])
    ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, grad_out, doc_lengths, scaling)
    mine = index[real]
    for got, expected in [
        (out[0, real].detach(), ref_out[mine]),
        (leaves[0].grad[0][:, real], ref_dq[:, mine]),
        (leaves[1].grad[0][:, real], ref_dk[:, mine]),
        (leaves[2].grad[0][:, real], ref_dv[:, mine]),
    ]:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # fmt: skip
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump({"forward": forward_log, "backward": log, "pieces": len(meta.pieces())}, handle)


@pytest.mark.slow
def test_ring_overlaps_gathers_and_reuses_the_forward(tmp_path):
    """The next head chunk's all-gather is issued before the current chunk's is waited for and attended; the key/value
    gradients' reduce-scatter of a chunk is waited for only after the next chunk's backward; the backward calls the
    kernel's backward from the forward's out and lse, never its forward. Results equal the reference (1e-5)."""
    import json

    result = tmp_path / "schedule.json"
    run_on_gloo_ranks(_schedule_worker, 2, str(result), preload=PRELOAD)
    got = json.loads(result.read_text())
    pieces, chunks = got["pieces"], 4
    forward, backward = ["G"], ["G"]
    for chunk in range(chunks):
        issue_next = ["G"] if chunk + 1 < chunks else []
        forward += issue_next + ["g"] + ["F"] * pieces
        backward += issue_next + ["g"] + ["B"] * pieces + ["S"] + (["s"] if chunk > 0 else [])
    backward += ["s"]
    assert got["forward"] == forward
    assert got["backward"] == backward


# ----------------------------------------------------------------------------------------------------------------
# bf16: gradients summed over blocks and ranks in float32.


def _relative_errors(grads, references):
    return [((g.float() - r).norm() / r.norm()).item() for g, r in zip(grads, references)]


def _bf16_ring_worker(rank, world_size, result_path):
    """One long document over a ring of `world_size` in bf16, small query blocks (many blocks per rank): the relative
    error (Frobenius) of dq/dk/dv against the fp32 reference on the same bf16-rounded inputs, next to the one-process
    bf16 error of the same row."""
    import json

    groups = init_sequence_parallel_groups(world_size)
    doc_lengths, scaling = [400, 37], 0.25
    length = sum(doc_lengths)
    q, k, v, grad_out = random_problem(4, 2, length, seed=11, head_dim=16)
    q, k, v, grad_out = (t.bfloat16().float() for t in (q, k, v, grad_out))  # the reference sees the bf16 inputs
    _, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, grad_out, doc_lengths, scaling)
    config = SequenceParallelConfig(sequence_parallel_size=world_size, ring_query_chunk_size=1)

    single = packed_row_metadata(positions(doc_lengths), config)
    leaves = [t.bfloat16()[None].requires_grad_() for t in (q, k, v)]
    out, _ = ring_attention_forward(MODULE, *leaves, None, scaling=scaling, ring_attn_meta=single)
    out.backward(grad_out.bfloat16()[None])
    one_process = _relative_errors([t.grad[0] for t in leaves], [ref_dq, ref_dk, ref_dv])

    shard = shard_packed_row(torch.zeros(1, length, dtype=torch.long), positions(doc_lengths)[None], groups=groups,
                             config=config)  # fmt: skip
    meta = shard.attention_meta
    index = meta.global_index()
    real = index < length
    pad = meta.num_padding
    local = [torch.cat([t, t.new_zeros(t.shape[0], pad, t.shape[2])], 1)[:, index] for t in (q, k, v)]
    leaves = [t.bfloat16()[None].requires_grad_() for t in local]
    dout = torch.zeros(index.numel(), q.shape[0], q.shape[2], dtype=torch.bfloat16)
    dout[real] = grad_out[index[real]].bfloat16()
    out, _ = ring_attention_forward(MODULE, *leaves, None, scaling=scaling, ring_attn_meta=meta)
    out.backward(dout[None])
    squares = torch.tensor(  # this rank's share of ||g - r||^2 for dq, dk, dv
        [(t.grad[0][:, real].float() - r[:, index[real]]).square().sum().item()
         for t, r in zip(leaves, (ref_dq, ref_dk, ref_dv))], dtype=torch.float64,
    )  # fmt: skip
    torch.distributed.all_reduce(squares)
    ring = [(squares[i].sqrt() / r.norm().double()).item() for i, r in enumerate((ref_dq, ref_dk, ref_dv))]
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump({"one_process": one_process, "ring": ring}, handle)


@pytest.mark.slow
def test_bf16_ring_gradients_as_accurate_as_one_process(tmp_path):
    """Ring of 4 in bf16 against the fp32 reference: the dq/dk/dv error is at most 1.5x the one-process bf16 error
    (key/value gradients of every block and rank are summed in float32 and cast once)."""
    import json

    result = tmp_path / "errors.json"
    run_on_gloo_ranks(_bf16_ring_worker, 4, str(result), preload=PRELOAD)
    errors = json.loads(result.read_text())
    for name, ring, single in zip(["dq", "dk", "dv"], errors["ring"], errors["one_process"]):
        assert ring <= 1.5 * single, f"{name}: ring of 4 error {ring:.2e}, one process {single:.2e}"


def test_masked_gqa_blocks_repeat_key_value_heads_off_cpu(monkeypatch):
    """A masked block (a piece entering from the previous rank, a response against its prompt) on CUDA: SDPA with a
    mask and `enable_gqa=True` can only take the math backend (float32 scores of the whole block), so the block
    kernel repeats the key/value heads instead. Checked on meta tensors (any device but CPU); CPU keeps GQA."""
    from trl_longrm.sequence_parallel import kernels

    calls = []

    def recording(query, key, value, **kwargs):
        calls.append((key.shape[1], kwargs["enable_gqa"], kwargs["attn_mask"] is not None))
        return query.new_empty(query.shape)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", recording)
    for device in ("meta", "cpu"):
        k, v = torch.empty(9, 2, 16, device=device), torch.empty(9, 2, 16, device=device)
        TorchBlockKernel._block(torch.empty(5, 8, 16, device=device), k, v, False, 0.25)  # bottom-right mask
        TorchBlockKernel._block(torch.empty(9, 8, 16, device=device), k, v, True, 0.25)  # is_causal, no mask
    # (key/value heads passed, enable_gqa, masked)
    assert calls == [(8, False, True), (2, True, False), (2, True, True), (2, True, False)]


@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("min_tokens,repeat_elements", [(1, 2**28), (10, 2**28), (1, 1)])
def test_cudnn_ops_on_emulated_ring_match_reference(group_size, min_tokens, repeat_elements):
    """cuDNN's fused attention as the kernels use it (`TorchCudnnOps`, on CPU with a stand-in of its aten ops and
    their conventions): a call per sequence it serves (all heads at once, or one key/value head's group per call
    where the repeated keys would pass `repeat_elements`), the rest (short ones, and pieces entering a rank from the
    previous one, which need a bottom-right mask) as varlen runs of the fallback. Ring geometry and plain autograd on
    one process (the differentiable function built from the two entry points) both match the reference."""
    from cudnn_stand_in import stand_in_cudnn_ops

    from trl_longrm.sequence_parallel.kernels import varlen_function_of

    num_heads, num_kv_heads, doc_lengths, scaling = 4, 2, [23, 3, 11, 40, 1], 0.25
    q, k, v, grad_out = random_problem(num_heads, num_kv_heads, sum(doc_lengths), seed=11)
    expected = reference_with_grads(q, k, v, grad_out, doc_lengths, scaling)
    expected = (expected[0], *(grad.transpose(0, 1) for grad in expected[1:]))
    ops, cudnn = stand_in_cudnn_ops(min_tokens, repeat_elements)
    kernel = VarlenKernel(ops.name, varlen_function_of(ops), ops)
    if group_size == 1:  # one process: the kernel's function under autograd, as `_attend` calls it
        leaves = [t.transpose(0, 1).clone().requires_grad_() for t in (q, k, v)]
        meta = packed_row_metadata(positions(doc_lengths), SequenceParallelConfig())
        out = kernel.forward(*leaves, meta, scaling)
        out.backward(grad_out)
        got = (out.detach(), *(t.grad for t in leaves))
    else:
        got = emulated_ring(kernel, q, k, v, grad_out, doc_lengths, group_size, chunk=1024, scaling=scaling)
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert cudnn.calls["forward"] > 0 and cudnn.calls["backward"] > 0  # cuDNN did serve some sequences
    assert cudnn.heads == {num_heads if repeat_elements > 1 else num_heads // num_kv_heads}


def test_cudnn_ops_route_sequences_by_length_and_alignment():
    """Which sequences cuDNN takes: causal square ones of at least `min_tokens` queries, each its own call; the others
    go to the fallback as one varlen call per run of consecutive ones, boundaries rebased to the run."""
    from cudnn_stand_in import stand_in_cudnn_ops

    ops, _ = stand_in_cudnn_ops(min_tokens=100)
    # Queries/keys per sequence: 300/300, 5/5, 7/7, 200/250 (a piece entering from the previous rank), 150/150.
    cu_q, cu_k = torch.tensor([0, 300, 305, 312, 512, 662]), torch.tensor([0, 300, 305, 312, 562, 712])
    runs = list(ops._runs(cu_q, cu_k, causal=True))
    assert [run[:5] for run in runs] == [
        (True, 0, 300, 0, 300), (False, 300, 512, 300, 562), (True, 512, 662, 562, 712)
    ]  # fmt: skip
    assert runs[1][5:] == ([0, 5, 12, 212], [0, 5, 12, 262], 200, 250)
    # Without the causal mask a non-square sequence is cuDNN's too.
    assert [run[0] for run in ops._runs(cu_q, cu_k, causal=False)] == [True, False, True, True]


def test_cudnn_backend_resolution():
    """'cudnn' names the kernel on CUDA half-precision tensors and is refused elsewhere; 'auto' picks it on CUDA where
    flash-attn is absent (resolution only: nothing runs)."""
    from trl_longrm.sequence_parallel import kernels

    cuda = torch.device("cuda")
    assert resolve_kernel("cudnn", cuda, torch.bfloat16).name == "torch_cudnn"
    with pytest.raises(ValueError, match="cudnn"):
        resolve_kernel("cudnn", torch.device("cpu"), torch.bfloat16)
    with mock.patch.object(kernels, "is_flash_attn_available", lambda: False), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (8, 0)):
        assert resolve_kernel("auto", cuda, torch.bfloat16).name == "torch_cudnn"
        assert resolve_kernel("auto", cuda, torch.float32).name == "torch"
    assert SequenceParallelConfig(ring_attn_backend="cudnn").ring_attn_backend == "cudnn"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("repeat_elements", [2**28, 1], ids=["all_heads", "head_group_per_call"])
def test_cuda_cudnn_ops_match_torch_varlen_at_model_shapes(causal, repeat_elements):
    """cuDNN's ops as `TorchCudnnOps` calls them against torch's `varlen_attn` ops on the same bf16 inputs at
    Qwen3-0.6B's heads (16 query, 8 key/value, dim 128) and odd lengths (sequences of 3001, 2053 and 77 queries; with
    `causal=False`, queries against longer keys as a shared prompt's responses): out, lse and the gradients from the
    same (out, lse); all heads in one call, and one key/value head's group per call (how sequences long enough to
    pass `repeat_elements` go). Runs only where a GPU is present."""
    from trl_longrm.sequence_parallel.kernels import TorchCudnnOps, TorchVarlenOps

    varlen = TorchVarlenOps.load()
    cudnn = TorchCudnnOps(varlen, min_tokens=1024, repeat_elements=repeat_elements)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths_q = [3001, 2053, 77]
    lengths_k = lengths_q if causal else [4099, 2500, 300]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), 16, 128, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(sum(lengths_k), 8, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    grad_out = torch.randn_like(q)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), 128**-0.5, causal)
    out, lse = cudnn.forward(q, k, v, *args)
    want_out, want_lse = varlen.forward(q, k, v, *args)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
    got = cudnn.backward(grad_out, q, k, v, want_out, want_lse, *args)
    want = varlen.backward(grad_out, q, k, v, want_out, want_lse, *args)
    for name, g, w in zip(["dq", "dk", "dv"], got, want):
        scale = w.float().abs().max()
        torch.testing.assert_close(
            g.float() / scale, w.float() / scale, atol=2e-2, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
