"""Scratch buffers a kernel allocates inside one call and frees before it returns: no output holds them, so a fake
kernel (which allocates the outputs only) leaves them out, but they are live at the call's peak.

PyTorch's CPU flash attention (`aten::_scaled_dot_product_flash_attention_for_cpu` and its backward, which SDPA and
our CPU kernels call) allocates one buffer per thread of the op's thread pool, sized by how it splits the queries
and keys (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, `cpu_flash_attention` and
`cpu_flash_attention_backward`; the splits in `flash_attention_kernel_impl` / `flash_attention_backward_kernel_impl`):

- forward: `num_thread x (q_split x kv_split + 2 q_split + q_split x head_dim)` in the accumulate type (float32 for
  bf16/fp16), and for bf16/fp16 `num_thread x q_split x kv_split` in the input's;
- backward: `num_thread x 2 q_split x kv_split` in the accumulate type, and as many in the input's for bf16/fp16;

with `q_split` 256 from 768 queries, 64 from 192, else 32 (never more than the queries), `kv_split` 512 (never more
than the keys). At 2 threads and 768+ queries the backward's is 2 MiB in float32: the peak of a row whose MLP is tiled
is in the attention's backward, and it is there. Measured: `tests/test_memory_plan.py`'s tiled-MLP cases.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


aten = torch.ops.aten

_REDUCED = (torch.bfloat16, torch.float16)


def _query_split(queries: int) -> int:
    return min(256 if queries >= 768 else 64 if queries >= 192 else 32, queries)


def cpu_flash_attention_workspace(func, args, threads: int | None = None) -> list[tuple[int, torch.dtype]]:
    """`(elements, dtype)` of the buffers `func` (one of torch's CPU flash-attention ops) allocates inside a call on
    `args` (q, k, v heads-first: [batch, heads, tokens, head_dim]); [] for any other op."""
    if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
        query, key, backward = args[0], args[1], False
    elif func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        query, key, backward = args[1], args[2], True
    else:
        return []
    threads = threads or torch.get_num_threads()
    q_split, kv_split = _query_split(query.shape[-2]), min(512, key.shape[-2])
    reduced = query.dtype in _REDUCED
    accumulate = torch.float32 if reduced else query.dtype
    if backward:
        return [(threads * 2 * q_split * kv_split, accumulate), (threads * 2 * q_split * kv_split * reduced, query.dtype)]
    per_thread = q_split * kv_split + 2 * q_split + q_split * query.shape[-1]
    return [(threads * per_thread, accumulate), (threads * q_split * kv_split * reduced, query.dtype)]


class KernelWorkspaces(TorchDispatchMode):
    """Allocates, around each call of a kernel with in-call buffers (`cpu_flash_attention_workspace`), buffers of
    their size, freed when the call returns: a memory tracker below this mode sees them as the run's allocator does.
    Enter it above the tracker (after it), so that its allocations go through the tracker."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        buffers = [torch.empty(n, dtype=dtype) for n, dtype in cpu_flash_attention_workspace(func, args) if n]
        try:
            return func(*args, **(kwargs or {}))
        finally:
            del buffers


__all__ = ["KernelWorkspaces", "cpu_flash_attention_workspace"]
