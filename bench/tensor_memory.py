"""Tensor-level memory of a training run on CPU, from `torch.profiler`'s allocator events (`profile_memory=True`).

`ru_maxrss` counts what the C allocator holds, not what tensors hold: glibc serves allocations under its (dynamic)
mmap threshold from heaps that it returns to the system only from the top, so freed activations can stay resident and
a peak RSS can sit well above the peak of live tensors. This module replays the allocator events of a profiled run and
reports, per optimizer step, the live tensor bytes at the step's start and their peak inside it (the CPU analogue of
`torch.cuda.max_memory_allocated`), with what was alive at that peak grouped by the operator (and Python callers) that
allocated it.

    recorder = TensorMemoryRecorder()          # a TrainerCallback; start it before the model is built
    recorder.start()
    model = ...; trainer = Trainer(..., callbacks=[recorder]); trainer.train()
    report = recorder.finish(steps)            # [{"step", "start_bytes", "peak_bytes", "top"}, ...]
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import TrainerCallback


MARK = 1_000_003
"""Step boundaries are uint8 tensors of `MARK + 2 * step` bytes (begin) and `MARK + 2 * step + 1` (end)."""


def allocator_events(profiler, callers: int = 5):
    """`(time_ns, ptr, bytes, owner)` of every CPU allocator event (bytes < 0: a free), in time order; `owner` names
    the operator that allocated and up to `callers` enclosing operators / Python frames."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag != _EventType.Allocation or node.extra_fields.device.type != "cpu":
            continue
        owner, chain = node.parent, []
        while owner is not None and len(chain) < callers:
            if owner.tag == _EventType.TorchOp:
                chain.append(owner.name)
            elif owner.tag == _EventType.PyCall:
                chain.append(owner.name.split("/")[-1][:70])
            owner = owner.parent
        fields = node.extra_fields
        events.append((node.start_time_ns, fields.ptr, fields.alloc_size, " < ".join(chain)))
    events.sort(key=lambda e: e[0])
    return events


def step_report(events, steps: int, top: int = 30, big_bytes: int = 64 * 2**20):
    """Per step: live tensor bytes at its start, their peak inside it, what was alive at the peak (by owner, marked as
    allocated before the step or in it), and every allocation or free of at least `big_bytes` (seconds into the step,
    bytes, live bytes after it, owner). Bytes allocated before the profiler started are not seen."""
    marks = {}
    for i, (_, _, size, _) in enumerate(events):
        if size > 0 and MARK <= size < MARK + 2 * steps:
            marks[size - MARK] = i
    report, live, cursor = [], {}, 0
    for step in range(steps):
        if 2 * step + 1 not in marks:
            break
        begin, end = marks[2 * step], marks[2 * step + 1]
        for _, ptr, size, owner in events[cursor:begin]:
            if size > 0:
                live[ptr] = (size, owner, step - 1)
            else:
                live.pop(ptr, None)
        current = start = sum(s for s, _, _ in live.values())
        peak, peak_live, big = start, dict(live), []
        for time_ns, ptr, size, owner in events[begin:end]:
            if size > 0:
                live[ptr] = (size, owner, step)
                current += size
            else:
                freed = live.pop(ptr, None)
                if freed is not None:
                    current += size
                    owner = freed[1]
            if abs(size) >= big_bytes:
                big.append([round((time_ns - events[begin][0]) / 1e9, 3), size, current, owner])
            if current > peak:
                peak, peak_live = current, dict(live)
        cursor = end
        by_owner = defaultdict(lambda: [0, 0])
        for size, owner, born in peak_live.values():
            entry = by_owner[("in step: " if born == step else "before:  ") + owner]
            entry[0] += size
            entry[1] += 1
        rows = sorted(by_owner.items(), key=lambda kv: -kv[1][0])[:top]
        report.append({"step": step, "start_bytes": start, "peak_bytes": peak,
                       "top": [[owner, size, count] for owner, (size, count) in rows], "big_events": big})
    return report


class TensorMemoryRecorder(TrainerCallback):
    """Profile allocator events from `start()` to `finish()` and mark the optimizer steps (see `step_report`)."""

    def __init__(self, callers: int = 5):
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True)
        self.callers = callers
        self._marks = []

    def start(self):
        self.profiler.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self._marks.append(torch.empty(MARK + 2 * state.global_step, dtype=torch.uint8))

    def on_step_end(self, args, state, control, **kwargs):
        self._marks.append(torch.empty(MARK + 2 * (state.global_step - 1) + 1, dtype=torch.uint8))

    def finish(self, steps: int):
        self.profiler.stop()
        return step_report(allocator_events(self.profiler, self.callers), steps)


def print_report(label: str, report, rows: int = 15) -> None:
    for step in report:
        print(f"{label} step {step['step']}: live tensors at start {step['start_bytes'] / 2**20:.0f} MiB, peak "
              f"{step['peak_bytes'] / 2**20:.0f} MiB (+{(step['peak_bytes'] - step['start_bytes']) / 2**20:.0f})")
    if report:
        print(f"{label} alive at the peak of step {report[-1]['step']}:")
        for owner, size, count in report[-1]["top"][:rows]:
            print(f"    {size / 2**20:8.1f} MiB  x{count:<5d} {owner[:170]}")
