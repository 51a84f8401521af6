"""Tensor-level memory of a training run on CPU, from `torch.profiler`'s allocator events (`profile_memory=True`).

`ru_maxrss` counts what the C allocator holds, not what tensors hold: glibc serves allocations under its (dynamic)
mmap threshold from heaps that it returns to the system only from the top, so freed activations can stay resident and
a peak RSS can sit well above the peak of live tensors. This module replays the allocator events of a profiled run and
reports, per optimizer step, the live tensor bytes at the step's start and their peak inside it (the CPU analogue of
`torch.cuda.max_memory_allocated`), with what was alive at that peak grouped by the operator (and Python callers) that
allocated it.

The profiler records an allocator event only on a thread that runs under it: the training thread, and gloo's worker
threads while they run a collective, but not a gloo worker thread dropping a finished collective's work object (and,
with it, the work's last references to its tensors) a moment after the caller's `wait()` returned. Which thread drops a
buffer last is a race, so a replay of the events would count a buffer freed there as live for the rest of the run: a
run-to-run difference of one DDP bucket of all parameters (the flat buffer `DistributedDataParallel` broadcasts its
module states through at setup) or one ring's gathered keys/values. While it profiles, the recorder makes sure the
training thread drops them last (`collectives_released_here`), and the report counts the training thread's tensors
only, not gloo's staging buffers (see `step_report`).

    recorder = TensorMemoryRecorder()          # a TrainerCallback; start it before the model is built
    recorder.start()
    model = ...; trainer = Trainer(..., callbacks=[recorder]); trainer.train()
    report = recorder.finish(steps)            # [{"step", "start_bytes", "peak_bytes", "top"}, ...]
"""

from __future__ import annotations

import os
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager

import torch
from transformers import TrainerCallback


MARK = 1_000_003
"""Step boundaries are uint8 tensors of `MARK + 2 * step` bytes (begin) and `MARK + 2 * step + 1` (end), freed as soon
as they are allocated: their allocation event is the boundary, and they are never counted as live."""


def allocator_events(profiler, callers: int = 5):
    """`(time_ns, ptr, bytes, owner, thread)` of every CPU allocator event (bytes < 0: a free), in time order; `owner`
    names the operator that allocated and up to `callers` enclosing operators / Python frames, `thread` the profiler's
    id of the thread it ran on."""
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
        events.append((node.start_time_ns, fields.ptr, fields.alloc_size, " < ".join(chain), node.start_tid))
    events.sort(key=lambda e: e[0])
    return events


def step_report(events, steps: int, top: int = 30, big_bytes: int = 64 * 2**20):
    """Per step: live tensor bytes at its start, their peak inside it, what was alive at the peak (by owner, marked as
    allocated before the step or in it), and every allocation or free of at least `big_bytes` (seconds into the step,
    bytes, live bytes after it, owner). Bytes allocated before the profiler started are not seen.

    Only the training thread's events count (the thread that allocates the step marks): gloo's worker threads allocate
    staging buffers of their own while they run a collective (an all-gather's flat output, for one), at times that
    overlap the training thread's work by chance, so counting them would make a peak depend on thread timing; they
    are the backend's, as NCCL's buffers are, which `torch.cuda.max_memory_allocated` does not count either."""
    training = next((e[4] for e in events if e[2] > 0 and MARK <= e[2] < MARK + 2 * steps), None)
    events = [e for e in events if e[4] == training] if training is not None else events
    marks, mark_events = {}, set()
    for i, (_, ptr, size, _, _) in enumerate(events):
        if size > 0 and MARK <= size < MARK + 2 * steps:
            marks[size - MARK] = i
            mark_events.add(i)
            # Its free (the next event at its address) is not a tensor of the run either.
            free = next((j for j in range(i + 1, len(events)) if events[j][1] == ptr), None)
            if free is not None and events[free][2] < 0:
                mark_events.add(free)
    events = [(e[0], None, 0, "", e[4]) if i in mark_events else e for i, e in enumerate(events)]
    report, live, cursor = [], {}, 0
    for step in range(steps):
        if 2 * step + 1 not in marks:
            break
        begin, end = marks[2 * step], marks[2 * step + 1]
        for _, ptr, size, owner, _ in events[cursor:begin]:
            if size == 0:
                continue
            if size > 0:
                live[ptr] = (size, owner, step - 1)
            else:
                live.pop(ptr, None)
        current = start = sum(s for s, _, _ in live.values())
        peak, peak_live, big = start, dict(live), []
        for time_ns, ptr, size, owner, _ in events[begin:end]:
            if size == 0:
                continue
            if size > 0:
                stale = live.get(ptr)  # an address handed out again: its earlier block was freed where not seen
                live[ptr] = (size, owner, step)
                current += size - (stale[0] if stale else 0)
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


# The methods of a process group that issue a collective (or point-to-point) operation and return its work.
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "allgather", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced", "_allgather_base",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter", "reduce", "send",
    "recv", "recv_anysource",
)  # fmt: skip

RELEASE_TIMEOUT = 60.0
"""Seconds a dropped work waits for gloo's worker thread to let go of it before giving up (with a warning)."""


class _ReleasedHere:
    """A collective's work whose tensors are freed by the thread that drops it. The work was handed aliases of the
    caller's tensors on storages of their own (`_aliases`: DLPack views of the same memory, whose storage frees nothing
    but its reference to the caller's tensor), so that whether the work still holds any of the memory, through the
    alias or a view it made of it, is exactly whether an alias's storage is alive. Dropped, it waits for the
    operation, drops the work, waits until every alias's storage is gone (gloo's worker thread lets go of a finished
    work a moment later, and then of its tensors one at a time), and only then lets go of the caller's tensors."""

    __slots__ = ("_work", "_tensors", "_alias_storages")

    def __init__(self, work, tensors, alias_storages):
        self._work, self._tensors, self._alias_storages = work, tensors, alias_storages

    def __getattr__(self, name):
        attribute = getattr(self._work, name)
        if not callable(attribute):
            return attribute
        # Bound to this wrapper, not to the work: in `issue(...).wait()` the wrapper must outlive the call.
        return lambda *args, **kwargs: getattr(self._work, name)(*args, **kwargs)

    def __del__(self):
        work, tensors, storages = self._work, self._tensors, self._alias_storages
        self._work = self._tensors = self._alias_storages = None
        try:
            work.wait()
        except Exception:  # its caller saw (or chose to ignore) the failure; the work is released all the same
            pass
        del work
        deadline = time.monotonic() + RELEASE_TIMEOUT
        while not all(storage.expired() for storage in storages):
            if time.monotonic() > deadline:
                warnings.warn("tensor_memory: a collective's work was not released in time; its tensors may be "
                              "counted live after they are freed", stacklevel=1)  # fmt: skip
                break
            os.sched_yield()
        del tensors  # here, on the thread that dropped the work, where the profiler sees the frees


def _aliases(value, tensors, storages):
    """`value` (a tensor, or lists / tuples of them, as a process group's methods take them) with each tensor replaced
    by an alias on a storage of its own (a DLPack view: same memory and layout), the tensor appended to `tensors` and a
    weak reference to the alias's storage to `storages`."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.dlpack import from_dlpack, to_dlpack

    if isinstance(value, torch.Tensor):
        alias = from_dlpack(to_dlpack(value.detach()))
        tensors.append(value)
        storages.append(StorageWeakRef(alias.untyped_storage()))
        return alias
    if isinstance(value, (list, tuple)):
        return type(value)(_aliases(item, tensors, storages) for item in value)
    return value


class _CopyOutOnWait:
    """The work of gloo's reduce-scatter: an all-reduce of a copy of the input, this rank's chunk of which `wait()`
    copies into the output."""

    def __init__(self, work, buffer, output, rank, size):
        self.work, self.buffer, self.output, self.rank, self.size = work, buffer, output, rank, size

    def wait(self, *args, **kwargs):
        done = self.work.wait(*args, **kwargs)
        self.output.copy_(self.buffer.chunk(self.size)[self.rank])
        return done

    def __getattr__(self, name):
        return getattr(self.work, name)


def _gloo_reduce_scatter_single(original):
    """`ProcessGroup.reduce_scatter_single` as gloo runs it (`ProcessGroupGloo::reduce_scatter_tensor_coalesced`: it
    clones the input and all-reduces the clone), in Python on a gloo group, so that the clone, which gloo's work holds
    and Python never sees, goes through `_ReleasedHere` too."""

    def method(self, output, input, opts=None):
        if self._get_backend_name() != "gloo":
            return original(self, output, input, *([opts] if opts is not None else []))
        from torch.distributed import AllreduceOptions

        options = AllreduceOptions()
        if opts is not None:
            options.reduceOp, options.timeout = opts.reduceOp, opts.timeout
        buffer = input.clone()
        return _CopyOutOnWait(self.allreduce([buffer], options), buffer, output, self.rank(), self.size())

    return method


def _broadcast_coalesced(process_group, tensors, buffer_size, src=0):
    """`torch.distributed._broadcast_coalesced` (what `DistributedDataParallel` syncs its parameters and buffers
    with) in Python: buckets as torch makes them (per dtype and device, each closed once it reaches `buffer_size`
    bytes), flattened, broadcast from `src` and copied back, one at a time (torch keeps two in flight), through the
    process group's `broadcast`, so that the flat buckets, which torch's C++ keeps out of Python's sight, go through
    `_ReleasedHere` too."""
    from torch.distributed import BroadcastOptions

    open_buckets, buckets = {}, []
    for tensor in tensors:
        key = (tensor.dtype, tensor.device)
        bucket = open_buckets.setdefault(key, [0, []])
        bucket[0] += tensor.numel() * tensor.element_size()
        bucket[1].append(tensor)
        if bucket[0] >= buffer_size:
            buckets.append(open_buckets.pop(key)[1])
    buckets.extend(bucket for _, bucket in open_buckets.values())
    options = BroadcastOptions()
    options.rootRank = src
    for bucket in buckets:
        flat = torch._utils._flatten_dense_tensors(bucket)
        process_group.broadcast([flat], options).wait()
        if process_group.rank() != src:
            for tensor, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(synced)
        del flat


@contextmanager
def collectives_released_here():
    """Within it, the tensors of every collective issued from Python (through `torch.distributed`'s functions, and
    `DistributedDataParallel`'s broadcast of its module states) are freed by the thread that drops the collective's
    work (see `_ReleasedHere`), where the profiler records it, not by gloo's worker thread. The gradient all-reduces
    that DDP's reducer issues from C++ are left alone: their buckets live as long as the model."""
    import torch.distributed as dist

    if not dist.is_available():
        yield
        return
    from torch._C._distributed_c10d import ProcessGroup

    def released_here(original):
        def method(self, *args, **kwargs):
            tensors, storages = [], []
            args = _aliases(args, tensors, storages)
            kwargs = {key: _aliases(value, tensors, storages) for key, value in kwargs.items()}
            work = original(self, *args, **kwargs)
            del args, kwargs  # from here on only the work holds the aliases
            return _ReleasedHere(work, tensors, storages) if work is not None and tensors else work

        return method

    saved = {name: ProcessGroup.__dict__[name] for name in COLLECTIVES if name in ProcessGroup.__dict__}
    saved_broadcast_coalesced = dist._broadcast_coalesced
    try:
        for name in saved:
            method = getattr(ProcessGroup, name)
            if name in ("reduce_scatter_single", "_reduce_scatter_base"):
                method = _gloo_reduce_scatter_single(method)
            setattr(ProcessGroup, name, released_here(method))
        dist._broadcast_coalesced = _broadcast_coalesced
        yield
    finally:
        for name, method in saved.items():
            setattr(ProcessGroup, name, method)
        dist._broadcast_coalesced = saved_broadcast_coalesced


class TensorMemoryRecorder(TrainerCallback):
    """Profile allocator events from `start()` to `finish()` and mark the optimizer steps (see `step_report`); in
    between, collectives free their tensors where the profiler sees it (`collectives_released_here`)."""

    def __init__(self, callers: int = 5, with_stack: bool = True):
        from torch.profiler import ProfilerActivity, profile

        # `with_stack=False`: no Python callers in the owners (the peaks are the same), far less overhead where Python
        # runs per module (DeepSpeed ZeRO-3's hooks).
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=with_stack)
        self.callers = callers
        self._released_here = collectives_released_here()

    def start(self):
        self._released_here.__enter__()
        self.profiler.start()

    def on_step_begin(self, args, state, control, **kwargs):
        torch.empty(MARK + 2 * state.global_step, dtype=torch.uint8)  # allocated and freed: the event is the mark

    def on_step_end(self, args, state, control, **kwargs):
        torch.empty(MARK + 2 * (state.global_step - 1) + 1, dtype=torch.uint8)

    def finish(self, steps: int):
        self.profiler.stop()
        self._released_here.__exit__(None, None, None)
        return step_report(allocator_events(self.profiler, self.callers), steps)


def print_report(label: str, report, rows: int = 15) -> None:
    for step in report:
        print(f"{label} step {step['step']}: live tensors at start {step['start_bytes'] / 2**20:.0f} MiB, peak "
              f"{step['peak_bytes'] / 2**20:.0f} MiB (+{(step['peak_bytes'] - step['start_bytes']) / 2**20:.0f})")
    if report:
        print(f"{label} alive at the peak of step {report[-1]['step']}:")
        for owner, size, count in report[-1]["top"][:rows]:
            print(f"    {size / 2**20:8.1f} MiB  x{count:<5d} {owner[:170]}")
