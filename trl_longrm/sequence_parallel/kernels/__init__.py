"""Attention kernels for the local queries of one ring rank against the gathered keys of its documents.

Tensors are token-major: queries `[local_length, Hq, D]`, keys/values `[local_end - kv_start, Hkv, D]` (the global
row's keys from the start of the document of this rank's first token up to its last token; no local query sees keys
outside that range). Query head `h` uses key/value head `h // (Hq / Hkv)` (grouped-query attention).

Kernels with a fused library's entry points (`reuses_forward`: flash-attn, torch's varlen, PyTorch's fused CPU
attention) return the log-sum-exp with the output (`forward_lse`) and take both back in the backward
(`backward_from`), as flash-attn's own autograd does: the ring keeps the local out and lse (the size of q) and never
recomputes the attention. The pure PyTorch block kernel, the fallback where no such library serves the dtype and
device, recomputes each block in its backward (`backward`). Gradients come back in float32: they are summed over
blocks here and over ranks by the ring in float32, then cast once to the inputs' dtype (as ring-flash-attention
accumulates), since bf16 sums over 64 blocks lose ~1e-2 relative.

The kernels live by library, one module each; this package re-exports them and resolves which one a run takes:

- `base`: the kernel contract (`VarlenKernel`, `VarlenOps`, `varlen_function_of`) and the helpers the modules share;
- `torch_block`: the pure PyTorch block kernel (`TorchBlockKernel`), any device and dtype;
- `flash_attn`: flash-attn 2's varlen kernels (`is_flash_attn_available`, `FlashAttnVarlenOps`);
- `torch_varlen`: torch's `varlen_attn` (`TorchVarlenOps`);
- `cudnn`: cuDNN's fused attention (`TorchCudnnOps`);
- `cpu_flash`: PyTorch's fused CPU attention (`TorchCpuFlashOps`);
- `shared_prefix`: shared-prefix rows on a varlen library's entry points (`SharedPrefixVarlenKernel`);
- here: the resolution (`resolve_kernel`, `auto_backend`: which kernel 'auto' takes on which card) and its overrides (`kernels_resolved_by`, `kernels_overridden`).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F  # noqa: F401  (`kernels.F`: tests patch SDPA through it)

from .base import (
    _HALF_DTYPES,
    VarlenFunction,
    VarlenKernel,
    VarlenOps,
    _deterministic,
    _fp32_zeros,
    _heads_first_lse,
    _pad_head_dim,
    _VarlenOpsFunction,
    boundary_tensors,
    host_boundaries,
    varlen_function_of,
)
from .cpu_flash import TorchCpuFlashOps
from .cudnn import TorchCudnnOps
from .flash_attn import FlashAttnVarlenOps, _flash_attn_varlen, is_flash_attn_available
from .shared_prefix import SharedPrefixVarlenKernel, _SharedPrefixLayout, _SharedPrefixVarlenFunction
from .torch_block import TorchBlockKernel
from .torch_varlen import TorchVarlenOps, _torch_varlen_function, _torch_varlen_gqa_kwargs


logger = logging.getLogger(__name__)

# Resolvers that take the place of the device's own kernels, innermost last: a memory plan of a CUDA run, traced on CPU
# fake tensors, gives our attention the CUDA kernels as allocations (`trl_longrm.memory_plan.planned_kernels`). A
# resolver returns a kernel, or None where the device's own applies.
_kernel_overrides: list = []


@contextlib.contextmanager
def kernels_resolved_by(resolver):
    """Within this context `resolve_kernel` asks `resolver(backend, device, dtype)` first."""
    _kernel_overrides.append(resolver)
    try:
        yield
    finally:
        _kernel_overrides.pop()


def kernels_overridden() -> bool:
    """Whether attention kernels are resolved by an override here (`kernels_resolved_by`): a plan's kernels are
    allocations only, so flash-attn need not be importable where the plan is made."""
    return bool(_kernel_overrides)


# From Hopper (compute capability 9.0) on, cuDNN's fused attention runs a long causal sequence at ~1.8x flash-attn 2's
# rate (H200, Llama-3.1-8B's heads at 32K: 577 against 320 TFLOP/s forward+backward, bench/results/gpu/h200/eight_b.log;
# H100, Qwen3-0.6B's: 570 against 323); flash-attn 2 has no Hopper kernels of its own. Before it (Ampere, Ada)
# flash-attn 2 is the fastest where installed.
CUDNN_PREFERRED_FROM = (9, 0)


def auto_backend(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """`(backend, reason)`: the kernel 'auto' resolves to on tensors of this device and dtype, and why.

    On CUDA half-precision tensors: cuDNN's fused attention on compute capability 9.0 and newer (Hopper, Blackwell),
    flash-attn 2 where it is importable on older cards, else cuDNN, else torch's kernels; torch's kernels elsewhere.
    `capability`: the card's compute capability (default: `torch.cuda.get_device_capability(device)`), given when
    planning for a card this machine does not have.

    Example:
    ```python
    >>> auto_backend(torch.device("cuda"), torch.bfloat16, capability=(9, 0))
    ('cudnn', "compute capability 9.0: cuDNN's fused attention is the fastest from Hopper on")
    ```
    """
    if device.type != "cuda" or dtype not in _HALF_DTYPES:
        return "torch", f"{dtype} on {device.type}: the fused CUDA kernels take CUDA half-precision tensors only"
    if capability is None:
        capability = tuple(torch.cuda.get_device_capability(device))
    cudnn = TorchCudnnOps.load() is not None
    flash = is_flash_attn_available()
    where = f"compute capability {capability[0]}.{capability[1]}"
    if cudnn and tuple(capability) >= CUDNN_PREFERRED_FROM:
        return "cudnn", f"{where}: cuDNN's fused attention is the fastest from Hopper on" + (
            " (flash-attn 2 is installed but slower here)" if flash else ""
        )
    if flash:
        return "flash_attn", f"{where}: flash-attn 2 is the fastest before Hopper"
    if cudnn:
        return "cudnn", f"{where}: flash-attn 2 is not installed; cuDNN's fused attention"
    return "torch", f"{where}: neither flash-attn 2 nor torch's cuDNN attention ops (torch >= 2.10) are available"


@functools.cache
def _log_auto_choice(backend: str, reason: str) -> None:
    """Say once per process which kernel 'auto' took and why (the resolution runs for every attention call)."""
    logger.info("ring_attn_backend='auto' resolved to '%s': %s.", backend, reason)


def resolve_kernel(backend: str, device: torch.device, dtype: torch.dtype):
    """The kernel for `backend` ('auto', 'torch', 'cudnn', 'flash_attn') on tensors of this device and dtype.

    'auto' takes the backend `auto_backend` names (cuDNN on Hopper and newer, flash-attn 2 before where installed,
    torch's kernels off CUDA), and logs it once. 'cudnn' is cuDNN's fused attention for long sequences with torch's
    `varlen_attn` for the rest (`TorchCudnnOps`); 'torch' torch's `varlen_attn` on CUDA, the pure PyTorch kernel
    elsewhere.

    Example:
    ```python
    >>> resolve_kernel("auto", torch.device("cpu"), torch.float32).name
    'torch'
    ```
    """
    if _kernel_overrides:
        kernel = _kernel_overrides[-1](backend, device, dtype)
        if kernel is not None:
            return kernel
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
        return VarlenKernel("flash_attn", _flash_attn_varlen, FlashAttnVarlenOps.load())
    if backend == "cudnn":
        if device.type != "cuda" or dtype not in _HALF_DTYPES:
            raise ValueError(
                f"ring_attn_backend='cudnn' runs on CUDA float16/bfloat16 tensors only, got {dtype} on {device}."
            )
        ops = TorchCudnnOps.load()
        if ops is None:
            raise ImportError(
                "ring_attn_backend='cudnn' needs torch's cuDNN attention ops and its varlen_attn (torch >= 2.10); "
                "this torch lacks them. Use ring_attn_backend='torch'."
            )
        return VarlenKernel(ops.name, varlen_function_of(ops), ops)
    if backend == "auto":
        choice, reason = auto_backend(device, dtype)
        _log_auto_choice(choice, reason)
        return resolve_kernel(choice, device, dtype)
    if backend == "torch":
        if device.type == "cuda" and dtype in _HALF_DTYPES:
            fn = _torch_varlen_function()
            if fn is not None:
                return VarlenKernel("torch_varlen", fn, TorchVarlenOps.load())
        return TorchBlockKernel()
    raise ValueError(f"Unknown ring attention backend {backend!r}; expected 'auto', 'torch' or 'flash_attn'.")


__all__ = [
    "CUDNN_PREFERRED_FROM",
    "FlashAttnVarlenOps",
    "SharedPrefixVarlenKernel",
    "TorchBlockKernel",
    "TorchCpuFlashOps",
    "TorchCudnnOps",
    "TorchVarlenOps",
    "VarlenFunction",
    "auto_backend",
    "boundary_tensors",
    "host_boundaries",
    "VarlenKernel",
    "VarlenOps",
    "is_flash_attn_available",
    "kernels_overridden",
    "kernels_resolved_by",
    "resolve_kernel",
    "varlen_function_of",
    # Private, importable from here as before the split (tests, `trl_longrm.memory_plan.planned_kernels`).
    "_HALF_DTYPES",
    "_SharedPrefixLayout",
    "_SharedPrefixVarlenFunction",
    "_VarlenOpsFunction",
    "_deterministic",
    "_flash_attn_varlen",
    "_fp32_zeros",
    "_heads_first_lse",
    "_pad_head_dim",
    "_torch_varlen_function",
    "_torch_varlen_gqa_kwargs",
]
