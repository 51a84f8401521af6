"""What a CUDA run of a stock trainer allocates where its code takes another path than on CPU, reproduced while a CPU
trace plans a CUDA run (`trl_longrm.memory_plan.trace`, device 'cuda'). Both were found by setting the plan beside
the peaks an H100 measured (`bench/gpu_plan_vs_measured.py`).

- Masked attention. Stock TRL's trainers pad the rows of a batch (chosen and rejected to one length), so transformers
  hands SDPA a boolean `[batch, 1, queries, keys]` mask. On CPU, SDPA's fused kernel takes that mask as it is. On CUDA,
  flash attention takes no mask, so the memory-efficient kernel runs, and before it ATen turns the boolean mask into an
  additive one of the query's dtype (`convert_boolean_attn_mask`) and, where the key length is not a multiple of 16,
  pads it (`preprocess_mask`): a `queries x keys` tensor per call, which the kernel's backward keeps (it takes the
  bias). At a 32K-token pair that is 4 GiB beside the 2 GiB boolean mask.
- TRL's log-probabilities. `trl.trainer.utils.selective_log_softmax` (CPOTrainer's log-probs, SFTTrainer's entropy)
  runs TRL's fused Triton kernel on CUDA (`trl.kernels.logprob_entropy`): four float32 values per token, and in the
  backward one gradient of the logits' size and dtype, where the CPU path keeps a float32 log-softmax of every row.
  The plan assumes Triton is there, as it is with PyTorch's CUDA wheels on Linux.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


_HALF = (torch.float16, torch.bfloat16)
# The memory-efficient kernel's alignment of the bias's last dimension (ATen's `preprocess_mask`).
_BIAS_ALIGNMENT = 16


def cuda_additive_mask(attn_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask CUDA's SDPA makes of a boolean one, padded as its memory-efficient kernel needs (a view of
    the padded tensor, the true key length)."""
    keys = attn_mask.shape[-1]
    padded = -(-keys // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    additive = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
    additive.masked_fill_(attn_mask.logical_not(), float("-inf"))
    if padded == keys:
        return additive
    aligned = torch.zeros((*attn_mask.shape[:-1], padded), dtype=dtype, device=attn_mask.device)
    aligned[..., :keys] = additive
    return aligned[..., :keys]


class _PlannedLogProbEntropy(torch.autograd.Function):
    """The allocations of TRL's fused log-prob/entropy kernel (`trl.kernels.logprob_entropy`): float32 log-probs,
    entropy and two per-token statistics kept for the backward (with the logits, which exist anyway), and a gradient
    like the logits. Values are not computed: a plan traces fake tensors."""

    @staticmethod
    def forward(ctx, logits, index, temperature, row_mask):
        logprobs = torch.empty(logits.shape[:-1], device=logits.device, dtype=torch.float32)
        entropy, log_z, expected_logit = (torch.empty_like(logprobs) for _ in range(3))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, log_z, expected_logit)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, _, _ = ctx.saved_tensors
        return torch.empty_like(logits, memory_format=torch.contiguous_format), None, None, None


def _planned_fused_logprob_entropy(logits, index, temperature=1.0, row_mask=None):
    return _PlannedLogProbEntropy.apply(logits, index, temperature, row_mask)


def _supported_on_cuda(logits, index=None, row_mask=None) -> bool:
    """TRL's check of its kernel's support (`_supports_trl_loss_kernel`) less the device test: the (fake, CPU)
    tensors stand for CUDA ones."""
    return (
        logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and 1 <= logits.ndim <= 3
        and logits.stride(-1) == 1
        and logits.shape[-1] > 0
        and (index is None or (index.shape == logits.shape[:-1] and index.dtype in (torch.int32, torch.int64)))
        and (row_mask is None or (index is not None and row_mask.shape == index.shape))
    )


@contextlib.contextmanager
def cuda_code_paths():
    """Within this context, SDPA with a boolean half-precision mask converts it as CUDA's SDPA does, and TRL's
    `selective_log_softmax` / `entropy_from_logits` take their CUDA (fused kernel) path."""
    original_sdpa = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None and attn_mask.dtype == torch.bool and query.dtype in _HALF:
            attn_mask = cuda_additive_mask(attn_mask, query.dtype)
        return original_sdpa(query, key, value, attn_mask, *args, **kwargs)

    import trl.trainer.utils as trl_utils
    saved = {name: getattr(trl_utils, name, None)
             for name in ("is_triton_available", "_supports_trl_loss_kernel", "_fused_logprob_entropy")}  # fmt: skip
    F.scaled_dot_product_attention = sdpa
    trl_utils.is_triton_available = lambda: True
    trl_utils._supports_trl_loss_kernel = _supported_on_cuda
    trl_utils._fused_logprob_entropy = _planned_fused_logprob_entropy
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original_sdpa
        for name, value in saved.items():
            if value is None:
                delattr(trl_utils, name)
            else:
                setattr(trl_utils, name, value)
