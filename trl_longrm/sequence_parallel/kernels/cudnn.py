"""cuDNN's fused attention (`TorchCudnnOps`): one call per long sequence through torch's aten cuDNN attention ops,
the other sequences through torch's `varlen_attn` (`TorchVarlenOps`) as the fallback.
"""

from __future__ import annotations

import torch

from .base import VarlenOps, _deterministic, boundary_tensors, host_boundaries
from .torch_varlen import TorchVarlenOps


class TorchCudnnOps(VarlenOps):
    """cuDNN's fused attention (the kernels SDPA's `CUDNN_ATTENTION` backend calls:
    `aten._scaled_dot_product_cudnn_attention` and its backward, as torch's own context parallelism calls them), one
    call per sequence. On an H100 it runs a long causal sequence at ~1.75x the TFLOP/s of torch's `varlen_attn`
    (`bench/gpu_attention_kernels.py`: 570 vs 323 forward+backward at 32K-64K tokens, Qwen3-0.6B heads).

    The sequences it does not serve go to `fallback` (torch's varlen ops), as one varlen call per run of consecutive
    such sequences: causal ones with fewer queries than keys (a document entering this ring rank from the previous
    one, which needs a bottom-right mask: cuDNN's causal mask is top-left aligned), and those under `min_tokens`
    queries, where a kernel launch per sequence costs more than the faster kernel saves. Grouped-query heads are
    repeated for cuDNN (its GQA support differs by version), in head chunks whose repeated keys stay under
    `repeat_elements` elements (0.5 GiB in bf16); their gradients are summed back in float32.
    """

    name = "torch_cudnn"

    def __init__(
        self, fallback: VarlenOps, min_tokens: int = 2048, repeat_elements: int = 2**28, forward_op=None,
        backward_op=None,
    ):  # fmt: skip
        self.fallback = fallback
        self.min_tokens = min_tokens
        self.repeat_elements = repeat_elements
        # The aten ops (a test passes stand-ins with their schema to run this on CPU).
        self.forward_op = forward_op or torch.ops.aten._scaled_dot_product_cudnn_attention
        self.backward_op = backward_op or torch.ops.aten._scaled_dot_product_cudnn_attention_backward

    @classmethod
    def load(cls, min_tokens: int = 2048) -> TorchCudnnOps | None:
        aten = torch.ops.aten
        if not hasattr(aten, "_scaled_dot_product_cudnn_attention") or not hasattr(
            aten, "_scaled_dot_product_cudnn_attention_backward"
        ):
            return None
        fallback = TorchVarlenOps.load()
        return None if fallback is None else cls(fallback, min_tokens)

    def _runs(self, cu_q, cu_k, causal):
        """`(use_cudnn, qa, qb, ka, kb, cu_q, cu_k, max_q, max_k)` per call: one per sequence cuDNN serves, one varlen
        call per run of consecutive sequences it leaves to the fallback (boundaries rebased to the run's start). The
        boundaries are read on the host (`host_boundaries`): no wait for the GPU."""
        cu_q, cu_k = host_boundaries(cu_q), host_boundaries(cu_k)
        pending: list[int] = []

        def flush():
            first, last = pending[0], pending[-1] + 1
            run_q = [c - cu_q[first] for c in cu_q[first : last + 1]]
            run_k = [c - cu_k[first] for c in cu_k[first : last + 1]]
            max_q = max(b - a for a, b in zip(run_q, run_q[1:]))
            max_k = max(b - a for a, b in zip(run_k, run_k[1:]))
            pending.clear()
            return (False, cu_q[first], cu_q[last], cu_k[first], cu_k[last], run_q, run_k, max_q, max_k)

        for i in range(len(cu_q) - 1):
            nq, nk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            if nq >= self.min_tokens and (not causal or nq == nk):
                if pending:
                    yield flush()
                yield (True, cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1], None, None, nq, nk)
            elif nq:
                pending.append(i)
        if pending:
            yield flush()

    def _head_chunks(self, q, k, num_keys):
        """`(query heads, key/value heads)` slices per cuDNN call of a sequence with `num_keys` keys: all heads at
        once, unless its keys repeated to the query heads would pass `repeat_elements`, then as few key/value heads
        per call as keep them under it (at least one). cuDNN is given one key/value head per query head, so grouped
        heads are repeated; bounded so, a 512K-token sequence of Llama-3.1-8B's heads repeats 0.5 GiB per call
        instead of 4 GiB."""
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        group = heads // kv_heads
        per_call = max(1, min(kv_heads, self.repeat_elements // max(1, num_keys * group * head_dim)))
        if kv_heads == heads:  # nothing is repeated
            per_call = kv_heads
        for h in range(0, kv_heads, per_call):
            hi = min(h + per_call, kv_heads)
            yield slice(h * group, hi * group), slice(h, hi)

    @staticmethod
    def _heads_first(t, heads):
        """`[T, Hkv, D]` -> `[1, heads, T, D]`, key/value heads repeated; a slice of some heads is copied first, so
        that cuDNN always gets the layout of a whole token-major tensor."""
        if not t.is_contiguous():
            t = t.contiguous()
        if t.shape[1] != heads:
            t = t.repeat_interleave(heads // t.shape[1], dim=1)
        return t.transpose(0, 1).unsqueeze(0)

    @staticmethod
    def serves(q) -> bool:
        """Whether cuDNN takes these heads: head dims that are multiples of 8 up to 128 (what every cuDNN 9 build
        SDPA dispatches to takes), and no deterministic backward asked for (torch calls cuDNN's backward
        nondeterministic)."""
        return q.shape[-1] % 8 == 0 and q.shape[-1] <= 128 and not _deterministic()

    def forward_fills_own_buffers(self, q) -> bool:
        return self.serves(q)  # else the fallback's outputs as they are

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        if not self.serves(q):
            return self.fallback.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        for cudnn, qa, qb, ka, kb, run_q, run_k, mq, mk in self._runs(cu_q, cu_k, causal):
            if not cudnn:
                out[qa:qb], lse[:, qa:qb] = self.fallback.forward(
                    q[qa:qb], k[ka:kb], v[ka:kb], *boundary_tensors(q.device, run_q, run_k), mq, mk, scale, causal
                )
                continue
            for hq, hk in self._head_chunks(q, k, kb - ka):
                n = hq.stop - hq.start
                block_out, block_lse = self.forward_op(
                    self._heads_first(q[qa:qb, hq], n), self._heads_first(k[ka:kb, hk], n),
                    self._heads_first(v[ka:kb, hk], n), None, True, 0.0, causal, False, scale=scale,
                )[:2]  # fmt: skip
                out[qa:qb, hq] = block_out[0].transpose(0, 1)
                lse[hq, qa:qb] = block_lse.reshape(n, qb - qa)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        if not self.serves(q):
            return self.fallback.backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal)
        # Each query and each key belongs to one sequence here: the gradients are written, not summed, in the
        # inputs' dtype (no float32 copy of a long row's dq).
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        no_rng = torch.zeros((), dtype=torch.long, device=q.device)
        for cudnn, qa, qb, ka, kb, run_q, run_k, mq, mk in self._runs(cu_q, cu_k, causal):
            if not cudnn:
                dq[qa:qb], dk[ka:kb], dv[ka:kb] = self.fallback.backward(
                    grad_out[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb], lse[:, qa:qb].contiguous(),
                    *boundary_tensors(q.device, run_q, run_k), mq, mk, scale, causal,
                )  # fmt: skip
                continue
            for hq, hk in self._head_chunks(q, k, kb - ka):
                n, n_kv = hq.stop - hq.start, hk.stop - hk.start
                dq_b, dk_b, dv_b = self.backward_op(
                    self._heads_first(grad_out[qa:qb, hq], n), self._heads_first(q[qa:qb, hq], n),
                    self._heads_first(k[ka:kb, hk], n), self._heads_first(v[ka:kb, hk], n),
                    self._heads_first(out[qa:qb, hq], n), lse[hq, qa:qb].reshape(1, n, qb - qa, 1).contiguous(),
                    no_rng, no_rng, None, None, None, qb - qa, kb - ka, 0.0, causal, scale=scale,
                )  # fmt: skip
                dq[qa:qb, hq] = dq_b[0].transpose(0, 1)
                for grad, into in ((dk_b, dk), (dv_b, dv)):
                    grad = grad[0].transpose(0, 1)  # [keys, n, D]
                    if n_kv != n:
                        grad = grad.unflatten(1, (n_kv, n // n_kv)).sum(2, dtype=torch.float32)
                    into[ka:kb, hk] = grad
        return dq, dk, dv
