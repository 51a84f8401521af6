"""cuDNN's fused-attention aten ops (`aten._scaled_dot_product_cudnn_attention` and its backward) emulated on CPU
with their schema and conventions, so that `TorchCudnnOps` runs here: 4-D `[B, H, S, D]` views, an lse of shape
`[B, H, S_q, 1]`, the same number of query and key/value heads, a causal mask aligned top-left (so a causal call
with fewer queries than keys, which cuDNN would mask wrongly for us, is refused), and a backward that takes the `out`
and `lse` it is given (PyTorch's fused CPU attention ops, the ones SDPA dispatches to on CPU, do the math)."""

from __future__ import annotations

import torch


class StandInCudnn:
    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}
        self.heads = set()  # query heads per call

    def forward(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                *, scale=None):  # fmt: skip
        assert q.dim() == 4 and q.shape[1] == k.shape[1] == v.shape[1], "cuDNN is given repeated key/value heads"
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
        assert not (is_causal and q.shape[2] != k.shape[2]), "a top-left causal mask on a non-square block"
        self.calls["forward"] += 1
        self.heads.add(q.shape[1])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        seed = offset = torch.zeros((), dtype=torch.long)
        return out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, offset, None

    def backward(self, grad_out, q, k, v, out, lse, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
                 max_q, max_k, dropout_p, is_causal, *, scale=None):  # fmt: skip
        assert lse.shape == (*q.shape[:3], 1) and lse.dtype == torch.float32
        assert attn_bias is None and cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
        assert (max_q, max_k) == (q.shape[2], k.shape[2]) and grad_out.shape == out.shape == q.shape
        assert not (is_causal and q.shape[2] != k.shape[2])
        self.calls["backward"] += 1
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse[..., 0].contiguous(), 0.0, is_causal, scale=scale
        )


def stand_in_cudnn_ops(min_tokens: int, repeat_elements: int = 2**28):
    """`TorchCudnnOps` on CPU: the stand-in for cuDNN, PyTorch's fused CPU attention as the varlen fallback."""
    from trl_longrm.sequence_parallel.kernels import TorchCpuFlashOps, TorchCudnnOps

    cudnn = StandInCudnn()
    ops = TorchCudnnOps(
        TorchCpuFlashOps(), min_tokens, repeat_elements, forward_op=cudnn.forward, backward_op=cudnn.backward
    )
    return ops, cudnn
