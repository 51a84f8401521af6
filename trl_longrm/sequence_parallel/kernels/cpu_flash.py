"""PyTorch's fused CPU attention (`TorchCpuFlashOps`): the varlen entry points on CPU, one aten flash-attention
call per sequence (blocks with a bottom-right mask for pieces entering from the previous rank).
"""

from __future__ import annotations

import torch

from .base import VarlenOps, _fp32_zeros, host_boundaries


class TorchCpuFlashOps(VarlenOps):
    """The same contract on CPU from PyTorch's fused CPU attention (`aten::_scaled_dot_product_flash_attention_for_cpu`
    and its backward, the ops SDPA itself dispatches to), one call per sequence. Shared-prefix rows on CPU use it: a
    response's scores against its long prompt are never materialised (the masked SDPA blocks of `TorchBlockKernel`
    keep `[queries, prompt]` score matrices alive for the backward), and the backward reuses the forward's lse.

    A causal sequence with fewer queries than keys (a document entering this ring rank from the previous one) goes in
    blocks of `query_chunk_size` queries with a bottom-right mask, so no `L x L` mask exists.
    """

    name = "torch_cpu_flash"

    def __init__(self, query_chunk_size: int = 1024):
        self.query_chunk_size = query_chunk_size

    @classmethod
    def load(cls, query_chunk_size: int = 1024) -> TorchCpuFlashOps | None:
        aten = torch.ops.aten
        if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") or not hasattr(
            aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
        ):
            return None
        return cls(query_chunk_size)

    def _blocks(self, cu_q, cu_k, causal):
        """`(qa, qb, ka, kb, mode)` per call, mode 'full', 'causal' (square) or 'bottom_right' (masked block)."""
        cu_q, cu_k = host_boundaries(cu_q), host_boundaries(cu_k)
        for i in range(len(cu_q) - 1):
            qa, qb, ka, kb = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            nq, nk = qb - qa, kb - ka
            if not causal or nq == nk:
                yield qa, qb, ka, kb, "causal" if causal else "full"
                continue
            for a in range(0, nq, self.query_chunk_size):
                b = min(a + self.query_chunk_size, nq)
                yield qa + a, qa + b, ka, ka + nk - nq + b, "bottom_right"

    @staticmethod
    def _mask(m, n, mode, dtype, device):
        if mode != "bottom_right":
            return None
        keep = torch.arange(n, device=device)[None, :] <= torch.arange(n - m, n, device=device)[:, None]
        return torch.zeros(m, n, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))

    @staticmethod
    def _heads_first(t):
        return t.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D]

    def forward_fills_own_buffers(self, q) -> bool:
        return True  # each block's outputs are copied into `out` and `lse`

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        for qa, qb, ka, kb, mode in self._blocks(cu_q, cu_k, causal):
            mask = self._mask(qb - qa, kb - ka, mode, q.dtype, q.device)
            block_out, block_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *(self._heads_first(t) for t in (q[qa:qb], k[ka:kb], v[ka:kb])),
                0.0, mode == "causal", attn_mask=mask, scale=scale,
            )  # fmt: skip
            out[qa:qb] = block_out[0].transpose(0, 1)
            lse[:, qa:qb] = block_lse[0]
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        dq, dk, dv = (_fp32_zeros(t) for t in (q, k, v))  # blocks of one sequence share keys: summed in float32
        for qa, qb, ka, kb, mode in self._blocks(cu_q, cu_k, causal):
            mask = self._mask(qb - qa, kb - ka, mode, q.dtype, q.device)
            dq_b, dk_b, dv_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *(self._heads_first(t) for t in (grad_out[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb])),
                lse[:, qa:qb].unsqueeze(0).contiguous(), 0.0, mode == "causal", attn_mask=mask, scale=scale,
            )  # fmt: skip
            dq[qa:qb] = dq_b[0].transpose(0, 1)
            dk[ka:kb] += dk_b[0].transpose(0, 1)
            dv[ka:kb] += dv_b[0].transpose(0, 1)
        return dq, dk, dv
