"""Attention kernels for the local queries of one ring rank against the gathered keys of its documents.

Tensors are token-major: queries `[local_length, Hq, D]`, keys/values `[local_end - kv_start, Hkv, D]` (the global
row's keys from the start of the document of this rank's first token up to its last token; no local query sees keys
outside that range). Query head `h` uses key/value head `h // (Hq / Hkv)` (grouped-query attention). Every kernel's
backward recomputes the attention of its chunk, so that only the local q/k/v are kept between forward and backward.
"""

from __future__ import annotations

import bisect
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
    """Pure PyTorch kernel: `scaled_dot_product_attention` over blocks of `query_chunk_size` queries, each against
    the keys of its documents with a document-causal mask, so no `L x L` mask or score matrix ever exists. Any device.
    """

    name = "torch"

    def _blocks(self, meta: RingAttentionMetadata):
        cu, offset = meta.cu_seqlens, meta.kv_start
        for a in range(0, meta.local_length, meta.query_chunk_size):
            b = min(a + meta.query_chunk_size, meta.local_length)
            first_doc_start = cu[bisect.bisect_right(cu, meta.local_start + a) - 1]
            yield a, b, first_doc_start - offset, meta.local_start + b - offset

    def _block(self, q, k, v, meta, doc_ids, a, b, k_lo, k_hi, scaling):
        q_rel = torch.arange(meta.local_start + a, meta.local_start + b, device=q.device) - meta.kv_start
        k_rel = torch.arange(k_lo, k_hi, device=q.device)
        mask = (doc_ids[q_rel][:, None] == doc_ids[k_lo:k_hi][None, :]) & (k_rel[None, :] <= q_rel[:, None])
        out = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1),
            k[k_lo:k_hi].transpose(0, 1),
            v[k_lo:k_hi].transpose(0, 1),
            attn_mask=mask,
            scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(0, 1)

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        doc_ids = meta.key_document_ids(q.device)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        for a, b, k_lo, k_hi in self._blocks(meta):
            out[a:b] = self._block(q, k, v, meta, doc_ids, a, b, k_lo, k_hi, scaling)
        return out

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        doc_ids = meta.key_document_ids(q.device)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            for a, b, k_lo, k_hi in self._blocks(meta):
                block = self._block(q, k, v, meta, doc_ids, a, b, k_lo, k_hi, scaling)
                torch.autograd.backward(block, grad_out[a:b])
        return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in (q, k, v))


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
