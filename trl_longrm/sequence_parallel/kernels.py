"""Attention kernels for the local queries of one ring rank against the gathered keys of its documents.

Tensors are token-major: queries `[local_length, Hq, D]`, keys/values `[local_end - kv_start, Hkv, D]` (the global
row's keys from the start of the document of this rank's first token up to its last token; no local query sees keys
outside that range). Query head `h` uses key/value head `h // (Hq / Hkv)` (grouped-query attention). Every kernel's
backward recomputes the attention of its chunk, so that only the local q/k/v are kept between forward and backward.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .sharding import RingAttentionMetadata


def is_flash_attn_available() -> bool:
    """Whether the `flash_attn` package can be imported."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:  # a broken build (e.g. CUDA mismatch) counts as absent
        return False
    return True


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
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=is_causal_square,
            scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        for a, b, key_ranges, square in self._blocks(meta):
            out[a:b] = self._block(q[a:b], self._keys(k, key_ranges), self._keys(v, key_ranges), square, scaling)
        return out

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
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


VarlenFunction = Callable[..., torch.Tensor]
"""`fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale) -> out`, token-major, causal with
bottom-right alignment per document (the flash-attn convention), grouped-query heads supported."""


class VarlenKernel:
    """Kernel on top of a variable-length attention function (flash-attn, torch's `varlen_attn`): one call per
    head chunk, with per-document query/key boundaries from `RingAttentionMetadata.varlen_layout`."""

    def __init__(self, name: str, fn: VarlenFunction):
        self.name = name
        self.fn = fn

    def _call(self, q, k, v, meta, scaling):
        cu_q, cu_k, max_q, max_k = meta.varlen_layout(q.device)
        # Head-chunk slices of transposed views: give the fused kernels plain contiguous [tokens, heads, dim] tensors.
        q, k, v = (t.contiguous() for t in (q, k, v))
        return self.fn(q, k, v, cu_q, cu_k, max_q, max_k, scaling)

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        return self._call(q, k, v, meta, scaling)

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out = self._call(q, k, v, meta, scaling)
        return torch.autograd.grad(out, (q, k, v), grad_out)


def _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=True)


def _torch_varlen_function() -> VarlenFunction | None:
    """torch's `varlen_attn` when this torch has the signature we rely on (window (-1, 0) = causal, GQA)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" not in parameters or "enable_gqa" not in parameters or "scale" not in parameters:
        return None

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1]
        )

    return fn


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def resolve_kernel(backend: str, device: torch.device, dtype: torch.dtype):
    """The kernel for `backend` ('auto', 'torch', 'flash_attn') on tensors of this device and dtype.

    Example:
    ```python
    >>> resolve_kernel("auto", torch.device("cpu"), torch.float32).name
    'torch'
    ```
    """
    if backend == "flash_attn":
        if not is_flash_attn_available():
            raise ImportError(
                "ring_attn_backend='flash_attn' needs the flash-attn package, which is not importable here "
                "(`pip install flash-attn --no-build-isolation` on a CUDA machine), or use ring_attn_backend='torch'."
            )
        if device.type != "cuda":
            raise ValueError(f"ring_attn_backend='flash_attn' runs on CUDA tensors only, got tensors on {device}.")
        if dtype not in _HALF_DTYPES:
            raise ValueError(f"ring_attn_backend='flash_attn' needs float16 or bfloat16 tensors, got {dtype}.")
        return VarlenKernel("flash_attn", _flash_attn_varlen)
    if backend == "auto":
        if device.type == "cuda" and dtype in _HALF_DTYPES and is_flash_attn_available():
            return VarlenKernel("flash_attn", _flash_attn_varlen)
        return resolve_kernel("torch", device, dtype)
    if backend == "torch":
        if device.type == "cuda" and dtype in _HALF_DTYPES:
            fn = _torch_varlen_function()
            if fn is not None:
                return VarlenKernel("torch_varlen", fn)
        return TorchBlockKernel()
    raise ValueError(f"Unknown ring attention backend {backend!r}; expected 'auto', 'torch' or 'flash_attn'.")
