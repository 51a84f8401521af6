"""Shared-prefix rows on a varlen library's entry points: the two calls of a slice (`_SharedPrefixLayout`), their
log-sum-exp merge and its autograd (`_SharedPrefixVarlenFunction`), and the kernel (`SharedPrefixVarlenKernel`).
"""

from __future__ import annotations

import torch

from ...memory.selective_checkpointing import keeps_attention_outputs
from ..sharding import RingAttentionMetadata
from .base import VarlenKernel, VarlenOps, _fp32_zeros, boundary_tensors


class _SharedPrefixLayout:
    """The two varlen calls that attend a shared-prefix slice exactly, without copying a prefix per response.

    - Call A (causal): every local document piece against its own document's keys up to its last local query, as for
      an ordinary packed row (a prefix attends only to itself; a response causally to itself).
    - Call B (full): the local queries of the responses of one prefix, all of them as one query sequence, against
      that prefix's (and its ancestors') keys, taken once per prefix.

    A response's output is the log-sum-exp merge of its two calls. Indices are relative to the local queries and to
    the keys `[kv_start, local_end)`.
    """

    def __init__(self, meta: RingAttentionMetadata, device: torch.device):
        cu, offset = meta.cu_seqlens, meta.kv_start
        documents = list(meta.local_documents())
        self.keys_a_start = cu[documents[0]] - offset
        cu_q_a, cu_k_a, max_q_a, max_k_a = [0], [0], 0, 0
        sequences_b: list[tuple[tuple[int, ...], int, int]] = []  # (ancestors, q_lo, q_hi), local query indices
        for doc in documents:
            doc_start, doc_end = cu[doc], cu[doc + 1]
            q_lo, q_hi = max(doc_start, meta.local_start), min(doc_end, meta.local_end)
            cu_q_a.append(cu_q_a[-1] + q_hi - q_lo)
            cu_k_a.append(cu_k_a[-1] + q_hi - doc_start)
            max_q_a, max_k_a = max(max_q_a, q_hi - q_lo), max(max_k_a, q_hi - doc_start)
            ancestors = tuple(meta.ancestors(doc))
            if not ancestors:
                continue
            a, b = q_lo - meta.local_start, q_hi - meta.local_start
            if sequences_b and sequences_b[-1][0] == ancestors and sequences_b[-1][2] == a:
                sequences_b[-1] = (ancestors, sequences_b[-1][1], b)  # the next response of the same prefix
            else:
                sequences_b.append((ancestors, a, b))
        self.call_a = (*boundary_tensors(device, cu_q_a, cu_k_a), max_q_a, max_k_a)
        self.key_ranges_b = [
            (cu[p] - offset, cu[p + 1] - offset) for ancestors, _, _ in sequences_b for p in ancestors
        ]
        cu_q_b, cu_k_b = [0], [0]
        for ancestors, a, b in sequences_b:
            cu_q_b.append(cu_q_b[-1] + b - a)
            cu_k_b.append(cu_k_b[-1] + sum(cu[p + 1] - cu[p] for p in ancestors))
        self.has_b = bool(sequences_b)
        if self.has_b:
            lengths_q = [cu_q_b[i + 1] - cu_q_b[i] for i in range(len(sequences_b))]
            lengths_k = [cu_k_b[i + 1] - cu_k_b[i] for i in range(len(sequences_b))]
            self.call_b = (*boundary_tensors(device, cu_q_b, cu_k_b), max(lengths_q), max(lengths_k))
            self.queries_b = torch.cat([torch.arange(a, b, device=device) for _, a, b in sequences_b])

    @classmethod
    def of(cls, meta: RingAttentionMetadata, device: torch.device) -> _SharedPrefixLayout:
        key = ("shared_prefix_varlen", str(device))
        if key not in meta._cache:
            meta._cache[key] = cls(meta, device)
        return meta._cache[key]

    def keys_b(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[lo:hi] for lo, hi in self.key_ranges_b])

    def forward(self, ops: VarlenOps, q, k, v, scale):
        """`(out, lse)` of every local query over all the keys it sees."""
        a = self.keys_a_start
        out, lse = ops.forward(q, k[a:].contiguous(), v[a:].contiguous(), *self.call_a, scale, True)
        if not self.has_b:
            return out, lse
        idx = self.queries_b
        out_b, lse_b = ops.forward(q[idx], self.keys_b(k), self.keys_b(v), *self.call_b, scale, False)
        if keeps_attention_outputs() and not ops.forward_fills_own_buffers(q):
            # `out` and `lse` are (views of) the attention op's outputs, which selective checkpointing keeps for the
            # recompute: torch refuses a kept tensor that was changed, and the recompute would read the merged values.
            # The merge writes into copies (flash-attn's and torch's varlen outputs; buffers the ops filled themselves,
            # PyTorch's CPU flash kernel's and cuDNN's, are nobody else's and merged in place).
            out, lse = out.clone(), lse.clone()
        lse_a = lse[:, idx]
        merged = torch.logaddexp(lse_a, lse_b)
        weight_a = torch.exp(lse_a - merged).transpose(0, 1).unsqueeze(-1)  # [n, H, 1]
        weight_b = torch.exp(lse_b - merged).transpose(0, 1).unsqueeze(-1)
        # The ops return fresh tensors (or copies, above): merge in place.
        out[idx] = (out[idx].float() * weight_a + out_b.float() * weight_b).to(out.dtype)
        lse[:, idx] = merged
        return out, lse

    def backward(self, ops: VarlenOps, grad_out, q, k, v, out, lse, scale, dq_dtype=torch.float32):
        """float32 `(dq, dk, dv)`; `dq_dtype=q.dtype` returns `dq` in the kernel's dtype instead, with the same values
        once cast: the responses' queries, the only ones with a second term, are summed in float32 and cast once, and
        the row's other queries keep the kernel's `dq` as it is (no float32 copy of the whole row's `dq`, the largest
        buffer of a long row's attention backward)."""
        a = self.keys_a_start
        dq, dk_a, dv_a = ops.backward(grad_out, q, k[a:].contiguous(), v[a:].contiguous(), out, lse, *self.call_a,
                                      scale, True)  # fmt: skip
        # The two calls' gradients (and every response's share of its prefix's) are summed in float32; the caller
        # casts once.
        if dq_dtype == torch.float32:
            dq = dq.float()
        dk, dv = _fp32_zeros(k), _fp32_zeros(v)
        dk[a:] += dk_a
        dv[a:] += dv_a
        if self.has_b:
            idx = self.queries_b
            dq_b, dk_b, dv_b = ops.backward(
                grad_out[idx], q[idx], self.keys_b(k), self.keys_b(v), out[idx], lse[:, idx].contiguous(),
                *self.call_b, scale, False,
            )  # fmt: skip
            if dq.dtype == torch.float32:
                dq.index_add_(0, idx, dq_b.float())  # in place: `dq` is this call's own
            else:
                dq[idx] = (dq[idx].float() + dq_b.float()).to(dq.dtype)
            at = 0
            for lo, hi in self.key_ranges_b:  # each prefix once, with the gradient of all its responses' queries
                dk[lo:hi] += dk_b[at : at + hi - lo]
                dv[lo:hi] += dv_b[at : at + hi - lo]
                at += hi - lo
        return dq, dk, dv


class _SharedPrefixVarlenFunction(torch.autograd.Function):
    """Autograd over the two calls: saves q/k/v and the merged out/lse, so the backward recomputes nothing."""

    @staticmethod
    def forward(ctx, q, k, v, layout, ops, scale):
        out, lse = layout.forward(ops, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.ops, ctx.scale = layout, ops, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.layout.backward(ctx.ops, grad_out, q, k, v, out, lse, ctx.scale, dq_dtype=q.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class SharedPrefixVarlenKernel:
    """A varlen library's kernels on a shared-prefix row: prefix and own keys attended by two calls and merged with
    their log-sum-exp (see `_SharedPrefixLayout`), the backward of each call taking the merged out and lse. No
    prefix's keys are copied per response: each is passed once per slice, for all of its responses."""

    reuses_forward = True
    _contiguous = staticmethod(VarlenKernel._contiguous)

    def __init__(self, ops: VarlenOps):
        self.ops = ops
        self.name = f"{ops.name}_shared_prefix"

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        layout = _SharedPrefixLayout.of(meta, q.device)
        return _SharedPrefixVarlenFunction.apply(*self._contiguous(q, k, v), layout, self.ops, scaling)

    def forward_lse(self, q, k, v, meta: RingAttentionMetadata, scaling: float):
        """`(out, lse)` merged over each query's prefix and own keys (no autograd)."""
        return _SharedPrefixLayout.of(meta, q.device).forward(self.ops, *self._contiguous(q, k, v), scaling)

    def backward_from(self, q, k, v, out, lse, grad_out, meta: RingAttentionMetadata, scaling: float):
        """float32 `(dq, dk, dv)` from the merged `out` and `lse`: no attention is recomputed."""
        layout = _SharedPrefixLayout.of(meta, q.device)
        return layout.backward(self.ops, *self._contiguous(grad_out, q, k, v, out, lse), scaling)

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        out, lse = self.forward_lse(q, k, v, meta, scaling)
        return self.backward_from(q, k, v, out, lse, grad_out, meta, scaling)
