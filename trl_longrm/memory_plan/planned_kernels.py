"""The CUDA attention kernels a memory plan traces on CPU fake tensors, where they cannot run: every tensor a kernel
call allocates, none computed. `planned_kernels('cuda', attention)` gives our attention these kernels in place of the
device's own (`trl_longrm.sequence_parallel.kernels.kernels_resolved_by`) while a plan is traced
(`trl_longrm.memory_plan.trace`); the runtime knows nothing of them.
"""

from __future__ import annotations

import contextlib

import torch

from trl_longrm.memory.selective_checkpointing import register_attention_forward_op
from trl_longrm.sequence_parallel.kernels import (
    _HALF_DTYPES,
    TorchCudnnOps,
    VarlenKernel,
    VarlenOps,
    auto_backend,
    kernels_resolved_by,
    varlen_function_of,
)


@torch.library.custom_op("trl_longrm::planned_flash_attn_forward", mutates_args=())
def planned_flash_attn_forward(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors flash-attn's varlen forward allocates (`out [Tq, H, Dv]`, float32 `softmax_lse [H, Tq]`), as one
    operator: a plan's trace sees it where a run sees flash-attn's own op (`flash_attn::_flash_attn_varlen_forward`),
    so that what keeps the op's outputs (selective checkpointing) keeps these."""
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@planned_flash_attn_forward.register_fake
def _planned_flash_attn_forward_fake(q, v):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


class PlannedFlashAttnOps(VarlenOps):
    """flash-attn 2's varlen kernels as a memory plan sees them: every tensor a call allocates, none computed.

    A memory plan of a CUDA run traces it on CPU fake tensors (`trl_longrm.memory_plan`), where flash-attn cannot
    run; these ops allocate what `mha_varlen_fwd` / `mha_varlen_bwd` (csrc/flash_attn/flash_api.cpp) do: the forward
    `out` and its float32 `softmax_lse [H, Tq]`; the backward `dq`/`dk`/`dv`, and for the kernel's duration a float32
    `dq_accum [Tq + 128, H, D rounded up to 32]`, a float32 `softmax_d [H, Tq + 128]` and, with grouped-query heads,
    `dk`/`dv` expanded to the query heads. Values are never read (fake tensors have none)."""

    name = "flash_attn"

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        return planned_flash_attn_forward(q, v)

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        batch = len(cu_q) - 1
        tokens, heads, head_dim = q.shape
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        workspace = [
            torch.empty(tokens + 128 * batch, heads, -(-head_dim // 32) * 32, dtype=torch.float32, device=q.device),
            torch.empty(heads, tokens + 128 * batch, dtype=torch.float32, device=q.device),
        ]
        if k.shape[1] != heads:
            workspace += [k.new_empty(k.shape[0], heads, k.shape[2]), v.new_empty(v.shape[0], heads, v.shape[2])]
        del workspace  # freed when the kernel returns
        return dq, dk, dv


class _PlannedFlashAttnFunction(torch.autograd.Function):
    """`flash_attn_varlen_func` as a memory plan sees it: `PlannedFlashAttnOps`, saving q, k, v, out and lse for the
    backward as flash-attn's autograd function does."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        ops = PlannedFlashAttnOps()
        out, lse = ops.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, True)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.layout = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = PlannedFlashAttnOps().backward(grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.layout, True)
        return dq, dk, dv, None, None, None, None, None


def cudnn_backward_workspace_bytes(query: torch.Tensor) -> int:
    """Bytes of the workspace one call of cuDNN's SDPA backward allocates for `query` (`[batch, heads, tokens,
    head_dim]`, heads-first as torch passes it): a float32 `dQ_accum [b, h_q, s_q, d_qk]` and a float32
    `softmax_sum [b, h_q, s_q]`.

    From cuDNN frontend's SDPA backward node (`include/cudnn_frontend/node/scaled_dot_product_flash_attention.h`,
    `get_fe_workspace_size_node`: alibi slopes + dQ_accum + dK/dV full-head buffers + softmax_sum): from cuDNN 9.0 on,
    the dQ accumulator is used whenever the backward is not deterministic (ours never is: `TorchCudnnOps.serves`) and
    has no bias gradient, the full-head dK/dV only for grouped heads (cuDNN is given one key/value head per query head
    here); torch's `run_cudnn_SDP_bprop` (aten/src/ATen/native/cudnn/MHA.cpp) takes the graph's workspace from the
    caching allocator for the call, so `max_memory_allocated` counts it. Measured: the Llama-3.1-8B LoRA run at a
    131,072-token prompt on an H200, whose layer peak is this backward (the tiled MLP), was 1.06 GiB above its plan
    without it (docs/gpu.md); 16 query heads per call there make it 1.01 GiB."""
    batch, heads, tokens, head_dim = query.shape
    return 4 * batch * heads * tokens * (head_dim + 1)


def _planned_cudnn_backward(grad_out, query, *args, **kwargs):
    """torch's cuDNN attention backward as a plan sees it: its meta kernel's outputs, with the call's workspace
    (`cudnn_backward_workspace_bytes`) allocated for its duration."""
    workspace = torch.empty(cudnn_backward_workspace_bytes(query), dtype=torch.uint8, device=query.device)
    try:
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(grad_out, query, *args, **kwargs)
    finally:
        del workspace  # freed when the kernel returns


def _planned_flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return _PlannedFlashAttnFunction.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)


# What selective checkpointing keeps: flash-attn's forward outputs, which this op stands for.
register_attention_forward_op(planned_flash_attn_forward._opoverload)

# The CUDA attention kernels a plan can trace: flash-attn 2's (what 'auto' takes before Hopper with it installed, and
# what 'flash_attn' and 'torch' allocate) and cuDNN's (what 'auto' takes from Hopper on).
PLANNED_CUDA_ATTENTION = ("flash_attn", "cudnn")

# The compute capability a plan made away from the GPUs plans 'auto' for: that of the cards the plan knows
# (`devices.DEVICE_MEMORY_BYTES`: H100, H200).
PLANNED_CAPABILITY = (9, 0)


def planned_cuda_attention(backend: str, capability: tuple[int, int] | None = None) -> str:
    """The attention kernels (`PLANNED_CUDA_ATTENTION`) a CUDA run with `ring_attn_backend=backend` takes, as
    `resolve_kernel` resolves it on half-precision CUDA tensors: 'cudnn' for 'cudnn'; flash-attn's allocations for
    'flash_attn' and 'torch' (torch's `varlen_attn` allocates as flash-attn's); for 'auto', what
    `kernels.auto_backend` picks on a card of compute capability `capability` (default: this machine's GPU, else
    `PLANNED_CAPABILITY`): cuDNN's from Hopper on, flash-attn 2's before it where installed."""
    if backend == "cudnn":
        return "cudnn"
    if backend == "auto":
        if capability is None and not torch.cuda.is_available():
            capability = PLANNED_CAPABILITY
        choice, _ = auto_backend(torch.device("cuda"), torch.bfloat16, capability)
        return "cudnn" if choice == "cudnn" else "flash_attn"
    return "flash_attn"


def _planned_resolver(attention: str):
    def resolve(backend, device, dtype):
        if dtype not in _HALF_DTYPES:
            return None  # float32 runs take the device's own kernels
        # The kernels 'auto' picks on CUDA (torch's varlen kernels allocate the same out and lse as flash-attn's).
        if attention == "cudnn":
            ops = TorchCudnnOps(PlannedFlashAttnOps(), backward_op=_planned_cudnn_backward)
            return VarlenKernel(ops.name, varlen_function_of(ops), ops)
        return VarlenKernel("flash_attn", _planned_flash_attn_varlen, PlannedFlashAttnOps())

    return resolve


@contextlib.contextmanager
def planned_kernels(device_type: str, attention: str = "flash_attn"):
    """Within this context, attention kernels are resolved as on `device_type`: on 'cuda', half-precision attention
    gets, whatever device the (fake) tensors are on, `attention`'s kernels: 'flash_attn' as `PlannedFlashAttnOps`
    (allocations only), 'cudnn' as `TorchCudnnOps` over torch's cuDNN attention ops (their meta kernels run on fake
    tensors) with `PlannedFlashAttnOps` for the sequences it leaves to torch's `varlen_attn` (which allocates as
    flash-attn's). On 'cpu', the CPU kernels a CPU run uses."""
    if attention not in PLANNED_CUDA_ATTENTION:
        raise ValueError(f"attention={attention!r}: expected one of {PLANNED_CUDA_ATTENTION}.")
    if device_type != "cuda":
        yield
        return
    with kernels_resolved_by(_planned_resolver(attention)):
        yield


__all__ = ["PLANNED_CUDA_ATTENTION", "PlannedFlashAttnOps", "cudnn_backward_workspace_bytes", "planned_cuda_attention",
           "planned_flash_attn_forward", "planned_kernels"]
