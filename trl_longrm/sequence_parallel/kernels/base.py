"""The kernel contract every attention kernel here follows: `VarlenKernel` (a kernel on a varlen library's function
and, optionally, its `VarlenOps`), `VarlenOps` (a library's forward-with-lse and backward-from-(out, lse) entry
points), `varlen_function_of` (a differentiable function from those entry points), and the helpers the libraries'
modules share (float32 gradient accumulators, int32 boundaries, head-dim padding, the lse layout, determinism).
Tensor layouts and conventions: the package docstring (`trl_longrm.sequence_parallel.kernels`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..sharding import RingAttentionMetadata, boundary_tensors, host_boundaries  # noqa: F401  (re-exported)


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _deterministic() -> bool:
    """flash-attn's `deterministic` backward where the user asked torch for deterministic algorithms."""
    return torch.are_deterministic_algorithms_enabled()


def _pad_head_dim(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero-pad the last dim to a multiple of 8, as flash-attn's public wrappers do before calling its kernels (which
    refuse other head dims). Zeros change neither scores nor `rowsum(dout * out)`."""
    pad = -tensors[0].shape[-1] % 8
    return tensors if not pad else tuple(F.pad(t, (0, pad)) for t in tensors)


def _fp32_zeros(t: torch.Tensor) -> torch.Tensor:
    """A float32 accumulator for gradients of `t` (half-precision sums over blocks and ranks lose ~1e-2 relative)."""
    return torch.zeros(t.shape, dtype=torch.float32, device=t.device)


VarlenFunction = Callable[..., torch.Tensor]
"""`fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale) -> out`, token-major, causal with
bottom-right alignment per document (the flash-attn convention), grouped-query heads supported."""


class VarlenKernel:
    """Kernel on top of a variable-length attention function (flash-attn, torch's `varlen_attn`): one call per
    head chunk, with per-document query/key boundaries from `RingAttentionMetadata.varlen_layout`.

    `fn` is the library's differentiable function (used under plain autograd on one process); `ops` (optional) are
    its forward-with-log-sum-exp and backward-from-(out, lse) entry points: with them the ring's backward reuses the
    forward's out and lse, and shared-prefix rows are attended by `SharedPrefixVarlenKernel` instead of the pure
    PyTorch kernel. `fn=None` makes the forward the ops' (PyTorch's fused CPU attention on a ring).
    """

    def __init__(self, name: str, fn: VarlenFunction | None, ops: VarlenOps | None = None):
        self.name = name
        self.fn = fn
        self.ops = ops

    @property
    def reuses_forward(self) -> bool:
        return self.ops is not None

    @staticmethod
    def _contiguous(*tensors):
        # Head-chunk slices of transposed views: give the fused kernels plain contiguous [tokens, heads, dim] tensors.
        return tuple(t.contiguous() for t in tensors)

    def forward(self, q, k, v, meta: RingAttentionMetadata, scaling: float) -> torch.Tensor:
        if self.fn is None:
            return self.forward_lse(q, k, v, meta, scaling)[0]
        return self.fn(*self._contiguous(q, k, v), *meta.varlen_layout(q.device), scaling)

    def forward_lse(self, q, k, v, meta: RingAttentionMetadata, scaling: float):
        """`(out, lse)`, lse float32 `[H, Tq]` (no autograd)."""
        return self.ops.forward(*self._contiguous(q, k, v), *meta.varlen_layout(q.device), scaling, True)

    def backward_from(self, q, k, v, out, lse, grad_out, meta: RingAttentionMetadata, scaling: float):
        """float32 `(dq, dk, dv)` from the forward's `out` and `lse`: no attention is recomputed."""
        grads = self.ops.backward(*self._contiguous(grad_out, q, k, v, out, lse), *meta.varlen_layout(q.device),
                                  scaling, True)  # fmt: skip
        return tuple(grad.float() for grad in grads)

    def backward(self, q, k, v, grad_out, meta: RingAttentionMetadata, scaling: float):
        """float32 `(dq, dk, dv)` with the forward recomputed (what a caller that kept no out/lse calls)."""
        if self.ops is not None:
            out, lse = self.forward_lse(q, k, v, meta, scaling)
            return self.backward_from(q, k, v, out, lse, grad_out, meta, scaling)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out = self.forward(q, k, v, meta, scaling)
        return tuple(grad.float() for grad in torch.autograd.grad(out, (q, k, v), grad_out))  # summed over ranks


class VarlenOps:
    """The two entry points of a varlen attention library that a log-sum-exp merge needs (flash-attn's convention):

    - `forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> (out, lse)`: token-major q `[Tq, H, D]`, k/v
      `[Tk, Hkv, D]`; `lse` is the natural-log softmax normaliser of every query, float32 `[H, Tq]`; `causal` is
      bottom-right aligned per sequence (query i of nq sees key j of nk iff j <= i + nk - nq), else full.
    - `backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal) -> (dq, dk, dv)`: the gradients
      of this call's keys given the *final* `out` and `lse` of the queries (which may also attend other keys): the
      softmax is recomputed as `exp(s - lse)` and its Jacobian uses `rowsum(grad_out * out)`, so a query's attention
      split over several calls and merged gets each call's exact share (as ring attention merges its blocks).
    """

    name = "varlen_ops"

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        raise NotImplementedError

    def forward_fills_own_buffers(self, q) -> bool:
        """Whether `forward` on these queries returns buffers it allocated and filled itself (the attention ops'
        outputs copied into them), not an attention op's own outputs or views of them: selective checkpointing keeps
        those for the recompute, and a caller must not write into them (the shared-prefix merge copies them first).
        False unless the library knows better."""
        return False

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        raise NotImplementedError


def _heads_first_lse(lse: torch.Tensor, q: torch.Tensor, library: str) -> torch.Tensor:
    """The lse as float32 `[H, Tq]` (flash-attn 2 and torch's flash kernel give that; torch documents `[Tq, H]`)."""
    tokens, heads = q.shape[0], q.shape[1]
    if lse.shape == (heads, tokens):
        return lse.float()
    if lse.shape == (tokens, heads):
        return lse.transpose(0, 1).float().contiguous()
    raise RuntimeError(
        f"{library} returned a log-sum-exp of shape {tuple(lse.shape)} for {tokens} queries of {heads} heads; the "
        "shared-prefix varlen path needs [heads, tokens]. Set shared_prefix=False or ring_attn_backend='torch'."
    )


class _VarlenOpsFunction(torch.autograd.Function):
    """A differentiable causal varlen attention from a library's two entry points (forward with lse, backward from
    out and lse), for libraries without their own autograd (cuDNN's fused ops)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, ops):
        out, lse = ops.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, True)
        ctx.save_for_backward(q, k, v, out, lse)
        # The boundaries are kept as they are, not as saved tensors: saved-tensor hooks (checkpoint offload) would
        # copy them off the GPU and back, and they would lose the host values they carry (`boundary_tensors`).
        ctx.boundaries = (cu_q, cu_k)
        ctx.max_q, ctx.max_k, ctx.scale, ctx.ops = max_q, max_k, scale, ops
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.ops.backward(grad_out.contiguous(), q, k, v, out, lse, *ctx.boundaries, ctx.max_q, ctx.max_k,
                                 ctx.scale, True)  # fmt: skip
        return (*(g.to(t.dtype) for g, t in zip(grads, (q, k, v))), None, None, None, None, None, None)


def varlen_function_of(ops: VarlenOps) -> VarlenFunction:
    """The causal varlen attention function (`VarlenKernel.fn`) of `ops`, differentiable through its entry points."""

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return _VarlenOpsFunction.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, ops)

    return fn
