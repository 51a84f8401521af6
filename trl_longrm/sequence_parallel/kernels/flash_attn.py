"""flash-attn 2's varlen kernels: whether they are importable (`is_flash_attn_available`), their causal varlen
function (`_flash_attn_varlen`) and their forward-with-lse and backward entry points (`FlashAttnVarlenOps`).
"""

from __future__ import annotations

import importlib.util
import inspect

import torch

from .base import VarlenOps, _deterministic, _heads_first_lse, _pad_head_dim


def is_flash_attn_available() -> bool:
    """Whether flash-attn 2's varlen interface can be imported. A flash-attn-4-only install (`flash_attn.cute`) makes
    `import flash_attn` succeed as a namespace package without it, and counts as absent."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # a broken build (e.g. CUDA mismatch), or no flash-attn 2 interface: absent
        return False
    return True


class FlashAttnVarlenOps(VarlenOps):
    """flash-attn 2's varlen forward (public, `return_attn_probs=True` for the lse) and its varlen backward (the
    private `_flash_attn_varlen_backward` that ring-flash-attention also calls; its signature is read at run time)."""

    name = "flash_attn"

    def __init__(self, backward_fn, backward_parameters):
        self._backward_fn = backward_fn
        self._backward_parameters = backward_parameters

    @classmethod
    def load(cls) -> FlashAttnVarlenOps | None:
        """The ops when this flash-attn has a varlen backward whose arguments we know, else None."""
        try:
            from flash_attn import flash_attn_interface
        except Exception:
            return None
        fn = getattr(flash_attn_interface, "_flash_attn_varlen_backward", None)
        if fn is None:
            return None
        # flash-attn >= 2.7 wraps it in `torch.library.custom_op`, whose own signature is `(*args, **kwargs)`: the
        # real parameters are those of the wrapped function (what ring-flash-attention reads too).
        parameters = set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
        needed = {"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k"}
        if not needed <= parameters:
            return None
        return cls(fn, parameters)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        from flash_attn import flash_attn_varlen_func

        with torch.no_grad():
            out, lse, _ = flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal, return_attn_probs=True
            )
        return out, _heads_first_lse(lse, q, "flash-attn")

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        head_dim = q.shape[-1]
        grad_out, q, k, v, out = _pad_head_dim(grad_out.contiguous(), q, k, v, out.contiguous())
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs = {
            "dout": grad_out, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse,
            "dq": dq, "dk": dk, "dv": dv, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q,
            "max_seqlen_k": max_k, "dropout_p": 0.0, "softmax_scale": scale, "causal": causal,
            "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1, "softcap": 0.0,
            "alibi_slopes": None, "deterministic": _deterministic(), "rng_state": None,
        }  # fmt: skip
        self._backward_fn(**{key: value for key, value in kwargs.items() if key in self._backward_parameters})
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


def _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=True,
        deterministic=_deterministic(),
    )  # fmt: skip
