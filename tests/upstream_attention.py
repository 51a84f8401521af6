"""The real Python layers of the CUDA attention libraries, run on CPU tensors.

- **flash-attn**: its source distribution on the package index holds its Python interface
  (`flash_attn/flash_attn_interface.py`: the public wrappers, the `torch.library` custom ops and their argument
  lists). It is downloaded once (`FLASH_ATTN_SDIST`, cached under `cache_dir()`, never committed) and imported with a
  CPU emulation of its compiled extension, `flash_attn_2_cuda` (`varlen_fwd` / `varlen_bwd` with the extension's
  positional arguments, return values and input checks, computed by `varlen_reference`), and CPU kernels registered
  for its custom ops (they are registered for CUDA only): the ops' own Python bodies, which call the emulation.
- **torch's `varlen_attn`**: the installed torch's own wrapper and custom ops, with CPU kernels registered for
  `torch_attn::_varlen_attn` and `torch_attn::_varlen_attn_backward` (their CUDA kernels call aten's flash
  attention), computed by `varlen_reference` with the ops' signatures and return values.

What this checks is the code between our kernels and the compiled kernels: the names, order and meaning of every
argument, the layouts of `out` and `lse`, padding of head dims, in-place gradients. The compiled kernels themselves
are the reference math; they run on a GPU only (`bench/gpu_defaults.py`, the CUDA tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import pytest
import torch
from varlen_reference import varlen_backward, varlen_forward


FLASH_ATTN_SDIST = "flash-attn==2.8.3.post2"
FLASH_ATTN_FILES = ("flash_attn/__init__.py", "flash_attn/flash_attn_interface.py")


def cache_dir() -> Path:
    """Where downloaded upstream sources are kept between runs (`TRL_LONGRM_TEST_CACHE`, else ~/.cache/trl_longrm)."""
    root = os.environ.get("TRL_LONGRM_TEST_CACHE") or Path.home() / ".cache" / "trl_longrm"
    return Path(root)


def unavailable(reason: str):
    """Skip where the package index cannot be reached; in CI (`CI` set) the upstream check must run, so fail."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the upstream conformance tests)")
    pytest.skip(reason)


def flash_attn_source() -> Path:
    """A directory holding flash-attn's `flash_attn` package sources (`FLASH_ATTN_FILES`) from its sdist."""
    name = FLASH_ATTN_SDIST.replace("==", "-")
    target = cache_dir() / name
    if all((target / f).exists() for f in FLASH_ATTN_FILES):
        return target
    with tempfile.TemporaryDirectory() as download:
        env = {**os.environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                   "--no-build-isolation", FLASH_ATTN_SDIST, "-d", download]  # fmt: skip
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            unavailable(f"downloading the {FLASH_ATTN_SDIST} source distribution timed out")
        archives = list(Path(download).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            unavailable(f"could not download the {FLASH_ATTN_SDIST} source distribution: {done.stderr.strip()[-500:]}")
        cache_dir().mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache_dir()))
        with tarfile.open(archives[0]) as archive:
            prefix = archive.getnames()[0].split("/")[0]
            for relative in FLASH_ATTN_FILES:
                member = archive.getmember(f"{prefix}/{relative}")
                (staging / relative).parent.mkdir(parents=True, exist_ok=True)
                (staging / relative).write_bytes(archive.extractfile(member).read())
        if not target.exists():
            staging.rename(target)  # atomic: a concurrent run sees all files or none
    return target


class EmulatedFlashAttn2Cuda(types.ModuleType):
    """`flash_attn_2_cuda`, the compiled extension of flash-attn 2.8, in PyTorch on CPU: `varlen_fwd` and `varlen_bwd`
    with its positional arguments and return values, and its input checks (fp16/bf16 only unless `allow_float32`,
    int32 cumulative lengths, a head dim that is a multiple of 8, contiguous last dims). Calls are recorded."""

    def __init__(self, allow_float32: bool = False):
        super().__init__("flash_attn_2_cuda")
        self.allow_float32 = allow_float32
        self.calls: list[tuple[str, dict]] = []

    def _check(self, q, k, v, cu_q, cu_k):
        allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_float32 else ())
        if q.dtype not in allowed:
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        if not (k.dtype == v.dtype == q.dtype):
            raise RuntimeError("query and key must have the same dtype")
        if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
            raise RuntimeError("cu_seqlens_q must have dtype int32")
        if q.shape[-1] % 8:
            raise RuntimeError("head_size should be a multiple of 8")
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            raise RuntimeError("Input tensor must have contiguous last dimension")
        if q.shape[1] % k.shape[1]:
            raise RuntimeError("Number of heads in key/value must divide number of heads in query")

    def varlen_fwd(self, q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
                   window_size_right, softcap, return_softmax, gen_):  # fmt: skip
        self._check(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if p_dropout or softcap or alibi_slopes is not None or block_table is not None or seqused_k is not None:
            raise NotImplementedError("the CPU emulation has no dropout, softcap, alibi, paged or used-k support")
        causal = bool(is_causal)
        if (window_size_left, window_size_right) not in ((-1, -1), (-1, 0)):
            raise NotImplementedError("the CPU emulation has no sliding window")
        causal = causal or window_size_right == 0
        self.calls.append(("varlen_fwd", {"causal": causal, "max_seqlen_q": max_seqlen_q, "head_dim": q.shape[-1]}))
        out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        if out_ is not None:
            out_.copy_(out)
            out = out_
        rng_state = torch.zeros(2, dtype=torch.int64)
        return out, lse, torch.empty(0, dtype=q.dtype), rng_state

    def varlen_bwd(self, dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
                   window_size_right, softcap, deterministic, gen_, rng_state):  # fmt: skip
        self._check(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if dout.stride(-1) != 1 or out.stride(-1) != 1:
            raise RuntimeError("out and dout must have contiguous last dimension")
        if softmax_lse.dtype != torch.float32 or tuple(softmax_lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"softmax_lse must be float32 [heads, total_q], got {tuple(softmax_lse.shape)}")
        causal = bool(is_causal) or window_size_right == 0
        self.calls.append(("varlen_bwd", {"causal": causal, "deterministic": deterministic, "head_dim": q.shape[-1]}))
        grads = varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        results = []
        for given, grad in zip((dq_, dk_, dv_), grads):
            if given is not None:
                given.copy_(grad)
                grad = given
            results.append(grad)
        softmax_d = (dout.float() * out.float()).sum(-1).transpose(0, 1).contiguous()
        return (*results, softmax_d)


def install_flash_attn(source: Path, allow_float32: bool = False) -> EmulatedFlashAttn2Cuda:
    """Import flash-attn's real `flash_attn` package from `source` with the emulated extension; returns the
    emulation (its `calls`). Undo with `uninstall_flash_attn`."""
    forget_flash_attn()  # e.g. a namespace package `flash_attn` imported from elsewhere
    emulation = EmulatedFlashAttn2Cuda(allow_float32)
    sys.modules["flash_attn_2_cuda"] = emulation
    sys.path.insert(0, str(source))
    import flash_attn.flash_attn_interface as interface

    for op in (interface._flash_attn_varlen_forward, interface._flash_attn_varlen_backward):
        if not getattr(op, "_trl_longrm_cpu_kernel", False):  # ops are registered once per process
            op.register_kernel("cpu")(op._init_fn)
            op._trl_longrm_cpu_kernel = True
    return emulation


def forget_flash_attn() -> None:
    """Drop every imported `flash_attn` module and the emulated extension from `sys.modules`."""
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]
    sys.modules.pop("flash_attn_2_cuda", None)


def uninstall_flash_attn(source: Path) -> None:
    """Forget the imported `flash_attn` (the custom ops stay registered with torch, harmlessly)."""
    forget_flash_attn()
    if str(source) in sys.path:
        sys.path.remove(str(source))


def torch_varlen_cpu_kernels() -> None:
    """CPU kernels for torch's `torch_attn::_varlen_attn` and `_varlen_attn_backward` (the installed torch's own
    custom ops, whose CUDA kernels call aten's flash attention), so that its real `varlen_attn` runs on CPU."""
    from torch.nn.attention import varlen

    if getattr(varlen, "_trl_longrm_cpu_kernels", False):
        return

    def forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
                enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
        window = list(window_size) if window_size is not None else [-1, -1]
        if window not in ([-1, -1], [-1, 0]) or seqused_k is not None or block_table is not None:
            raise NotImplementedError("the CPU kernel has no sliding window or paged keys")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out, lse = varlen_forward(query, key, value, cu_seq_q, cu_seq_k, scale, is_causal or window == [-1, 0])
        return out, lse, torch.zeros(2, dtype=torch.uint64)

    def backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                 scale=None, window_size=None):  # fmt: skip
        window = list(window_size) if window_size is not None else [-1, -1]
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        causal = is_causal or window == [-1, 0]
        return varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, scale, causal)

    varlen._varlen_attn.register_kernel("cpu")(forward)
    varlen._varlen_attn_backward.register_kernel("cpu")(backward)
    varlen._trl_longrm_cpu_kernels = True
