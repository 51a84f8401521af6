"""Where one training step's time goes on a GPU: a `TrainerCallback` that runs `torch.profiler` over the last step of a
run and sums the device kernels into attention, matrix multiplication and the rest, next to the step's wall time.

The split answers what bounds a throughput figure: kernels (attention or GEMM share of the busy time), or the host
(the GPU idle for part of the step: Python, kernel launches, synchronisation). Used by `gpu_longest_row.py --profile`.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback


# Kernel names by family. Attention: flash-attn / torch's varlen (flash) / cuDNN / memory-efficient SDPA kernels.
# GEMM: cuBLAS(Lt) and CUTLASS kernels (sm90 'nvjet' and 'xmma' ones included).
_ATTENTION = ("flash", "fmha", "attention", "varlen", "cudnn_sdpa", "mem_eff")
_GEMM = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "s16816", "wgmma")


def kernel_family(name: str) -> str:
    lowered = name.lower()
    if any(key in lowered for key in _ATTENTION):
        return "attention"
    if any(key in lowered for key in _GEMM):
        return "gemm"
    return "other"


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels of several streams may overlap)."""
    busy, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        busy += end - max(start, end_so_far)
        end_so_far = end
    return busy


def summarize(events, wall_seconds: float, device_type, top: int = 12) -> dict:
    """Kernel time by family, the device's busy fraction of the step and the `top` kernels, from the profiler's
    `events()` of one step; `device_type` is the profiler's `DeviceType` of the kernels (CUDA on a GPU)."""
    kernels = [e for e in events if e.device_type == device_type]
    by_family: dict[str, float] = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    by_name: dict[str, list] = {}
    intervals = []
    for event in kernels:
        duration = event.time_range.end - event.time_range.start  # microseconds
        by_family[kernel_family(event.name)] += duration
        entry = by_name.setdefault(event.name, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
        intervals.append((event.time_range.start, event.time_range.end))
    total = sum(by_family.values())
    busy = _busy_us(intervals)
    return {
        "step_wall_seconds": wall_seconds,
        "kernel_seconds": total / 1e6,
        "device_busy_fraction": busy / 1e6 / wall_seconds if wall_seconds else None,
        "kernel_share": {family: (value / total if total else 0.0) for family, value in by_family.items()},
        "kernel_seconds_by_family": {family: value / 1e6 for family, value in by_family.items()},
        "top_kernels": [
            {"name": name[:160], "seconds": seconds / 1e6, "calls": calls, "family": kernel_family(name)}
            for name, (seconds, calls) in sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
        ],
    }


class ProfileLastStep(TrainerCallback):
    """Profiles optimizer step `step` (1-based; the last of a run by default) and keeps `summarize`'s dict in
    `self.result`. On a machine without CUDA it profiles CPU ops instead (a rehearsal of the same code)."""

    def __init__(self, step: int):
        self.step = step
        self.result: dict | None = None
        self._profiler = None
        self._start = 0.0

    def _device(self):
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity

        if torch.cuda.is_available():
            return [ProfilerActivity.CPU, ProfilerActivity.CUDA], DeviceType.CUDA
        return [ProfilerActivity.CPU], DeviceType.CPU

    def _synchronize(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 != self.step:
            return
        from torch.profiler import profile

        activities, _ = self._device()
        self._synchronize()
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is None:
            return
        self._synchronize()
        wall = time.perf_counter() - self._start
        self._profiler.__exit__(None, None, None)
        _, device_type = self._device()
        self.result = summarize(self._profiler.events(), wall, device_type)
        self._profiler = None
