"""The pure PyTorch block kernel (`TorchBlockKernel`): SDPA over each document piece of the local queries, on any
device and dtype; the fallback where no fused varlen library serves the tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..sharding import RingAttentionMetadata
from .base import _fp32_zeros


class TorchBlockKernel:
    """Pure PyTorch kernel over the document pieces of the local queries, any device.

    A piece that starts at its document's start attends with one `is_causal` call (the fused CPU/CUDA kernels, no
    mask, memory linear in its length). A piece that starts inside its document (a document crossing into this rank
    from the previous one) sees every earlier key of that document: its queries go in blocks of `query_chunk_size`
    with a bottom-right causal mask, so no `L x L` mask or score matrix ever exists.

    A document that continues a shared prefix (`meta.segment_parents`) attends to its prefix in full and causally to
    itself: its query blocks see the prefix's keys followed by their own document's keys up to the block's end, which
    is again bottom-right causal over the concatenated keys, so the same block call serves both.
    """

    name = "torch"
    reuses_forward = False

    def _blocks(self, meta: RingAttentionMetadata):
        """`(a, b, key_ranges, is_causal_square)`: local queries `[a, b)` against the keys of `key_ranges`, a tuple
        of `(k_lo, k_hi)` relative to `kv_start`, concatenated in order."""
        offset = meta.kv_start
        cu = meta.cu_seqlens
        for doc in meta.local_documents():
            doc_start, doc_end = cu[doc], cu[doc + 1]
            q_lo, q_hi = max(doc_start, meta.local_start), min(doc_end, meta.local_end)
            prefix = tuple((cu[p] - offset, cu[p + 1] - offset) for p in meta.ancestors(doc))
            if q_lo == doc_start and not prefix:
                yield q_lo - meta.local_start, q_hi - meta.local_start, ((doc_start - offset, q_hi - offset),), True
                continue
            for a in range(q_lo, q_hi, meta.query_chunk_size):
                b = min(a + meta.query_chunk_size, q_hi)
                yield a - meta.local_start, b - meta.local_start, (*prefix, (doc_start - offset, b - offset)), False

    @staticmethod
    def _keys(t, key_ranges):
        if len(key_ranges) == 1:
            return t[key_ranges[0][0] : key_ranges[0][1]]
        return torch.cat([t[lo:hi] for lo, hi in key_ranges])

    @staticmethod
    def _block(q, k, v, is_causal_square, scaling):
        """q `[m, H, D]` against k/v `[n, Hkv, D]`; causal (square) or bottom-right causal (query i sees keys up to
        `i + n - m`)."""
        # [1, heads, tokens, dim]: the batched 4-D layout takes SDPA's fused kernels (3-D inputs fall back to math).
        query = q.transpose(0, 1).unsqueeze(0)
        key = k.transpose(0, 1).unsqueeze(0)
        value = v.transpose(0, 1).unsqueeze(0)
        mask = None
        if not is_causal_square:
            m, n = q.shape[0], k.shape[0]
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - m, n, device=q.device)[:, None]
        gqa = q.shape[1] != k.shape[1]
        if gqa and mask is not None and q.device.type != "cpu":
            # On CUDA a masked call can only take the memory-efficient backend, which refuses `enable_gqa`: with it
            # SDPA falls back to the math backend, which materialises float32 scores ([heads, m, n], 8 GiB for 16
            # heads x 1K queries x 128K keys). Repeating the key/value heads keeps it on the fused kernel.
            group = q.shape[1] // k.shape[1]
            key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
            gqa = False
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal_square, scale=scaling, enable_gqa=gqa
        )
        return out[0].transpose(0, 1)

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        for a, b, key_ranges, square in self._blocks(meta):
            out[a:b] = self._block(q[a:b], self._keys(k, key_ranges), self._keys(v, key_ranges), square, scaling)
        return out

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        dq, dk, dv = (_fp32_zeros(t) for t in (q, k, v))  # summed over blocks in float32, cast once by the caller
        for a, b, key_ranges, square in self._blocks(meta):
            # Each block's own slices are the leaves: differentiating the whole q/k/v instead would materialise and
            # add a full-size gradient per block (cost: blocks x row length, 7x the forward on a packed row).
            q_b = q[a:b].detach().requires_grad_()
            k_b = self._keys(k, key_ranges).detach().requires_grad_()
            v_b = self._keys(v, key_ranges).detach().requires_grad_()
            with torch.enable_grad():
                block = self._block(q_b, k_b, v_b, square, scaling)
            dq_b, dk_b, dv_b = torch.autograd.grad(block, (q_b, k_b, v_b), grad_out[a:b])
            dq[a:b] += dq_b
            at = 0
            for lo, hi in key_ranges:  # a shared prefix's keys receive the gradient of every response block
                dk[lo:hi] += dk_b[at : at + hi - lo]
                dv[lo:hi] += dv_b[at : at + hi - lo]
                at += hi - lo
        return dq, dk, dv
