"""Where the tensors live at a CUDA run's peak come from: torch's allocator history (`torch.cuda.memory.
_record_memory_history`) replayed up to the peak of allocated bytes, and the blocks live then summed by the code that
allocated them. Answers the question a plan-vs-measured gap leaves: which tensors the run keeps that the plan does not.

    recorder = MemorySites(); recorder.start(); ...run...; sites = recorder.finish()   # [{site, bytes, blocks}, ...]
"""

from __future__ import annotations


# Frames of these packages name a site (the innermost one of them); torch's own frames only where nothing else does.
_SITE_PACKAGES = ("trl_longrm", "peft", "transformers", "trl", "liger_kernel", "accelerate")


def _site(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(f"/{package}/" in name for package in _SITE_PACKAGES):
            return f"{name.split('site-packages/')[-1]}:{frame.get('line')} {frame.get('name')}"
    first = frames[0] if frames else {}
    return f"{first.get('filename', '?')}:{first.get('line')} {first.get('name')}"


def live_at_peak(snapshot: dict, top: int = 20) -> dict:
    """The blocks live when the allocated bytes of the snapshot's trace peaked (allocations made before the
    recording began are not in it), summed by allocating site, largest first."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    total, peak, peak_index = 0, 0, -1
    sizes = {}
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in sizes:
            total -= sizes.pop(event["addr"])
        if total > peak:
            peak, peak_index = total, i
    live = {}
    for event in events[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    by_site: dict[str, list] = {}
    for event in live.values():
        entry = by_site.setdefault(_site(event.get("frames", [])), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    sites = [{"site": site, "bytes": size, "blocks": blocks}
             for site, (size, blocks) in sorted(by_site.items(), key=lambda item: -item[1][0])]  # fmt: skip
    return {"peak_bytes_recorded": peak, "sites": sites[:top]}


class MemorySites:
    """Records the CUDA allocator's history from `start()`; `finish()` returns `live_at_peak` of it (None without
    CUDA: a rehearsal on CPU)."""

    def start(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

    def finish(self, top: int = 20) -> dict | None:
        import torch

        if not torch.cuda.is_available():
            return None
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        return live_at_peak(snapshot, top)
