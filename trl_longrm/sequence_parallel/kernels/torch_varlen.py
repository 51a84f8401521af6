"""torch's `varlen_attn` (`torch.nn.attention.varlen`, torch >= 2.10): its causal varlen function
(`_torch_varlen_function`) and its forward-with-lse and backward entry points (`TorchVarlenOps`).
"""

from __future__ import annotations

import inspect

import torch

from .base import VarlenFunction, VarlenOps, _heads_first_lse


class TorchVarlenOps(VarlenOps):
    """torch's `varlen_attn` (`return_aux` for the lse) and the backward op its own autograd calls
    (`torch.ops.torch_attn._varlen_attn_backward`), which takes the out and lse to use."""

    name = "torch_varlen"

    @classmethod
    def load(cls) -> TorchVarlenOps | None:
        try:
            from torch.nn.attention.varlen import AuxRequest, varlen_attn  # noqa: F401

            op = torch.ops.torch_attn._varlen_attn_backward
        except (ImportError, AttributeError, RuntimeError):
            return None
        arguments = [argument.name for argument in op.default._schema.arguments]
        expected = ["grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q", "max_k"]
        if arguments[: len(expected)] != expected or "is_causal" not in arguments or "rng_state" not in arguments:
            return None
        return cls()

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        with torch.no_grad():
            out, lse = varlen_attn(
                q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True), scale=scale,
                window_size=(-1, 0) if causal else (-1, -1), **_torch_varlen_gqa_kwargs(varlen_attn, q, k),
            )  # fmt: skip
        return out, _heads_first_lse(lse, q, "torch varlen_attn")

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
        return torch.ops.torch_attn._varlen_attn_backward(
            grad_out.contiguous(), q, k, v, out.contiguous(), lse, cu_q, cu_k, max_q, max_k, causal, rng_state,
            scale=scale, window_size=[-1, 0] if causal else [-1, -1],
        )  # fmt: skip


def _torch_varlen_function() -> VarlenFunction | None:
    """torch's `varlen_attn` when this torch has the signature we rely on (window (-1, 0) = causal, GQA)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" not in parameters or "scale" not in parameters:
        return None

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0),
            **_torch_varlen_gqa_kwargs(varlen_attn, q, k),
        )  # fmt: skip

    return fn


def _torch_varlen_gqa_kwargs(varlen_attn, q, k) -> dict:
    """`enable_gqa` where this torch's `varlen_attn` has it (2.13); torch 2.11's has no such argument and takes
    grouped-query heads natively (fewer key/value heads than query heads)."""
    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        return {"enable_gqa": q.shape[1] != k.shape[1]}
    return {}
