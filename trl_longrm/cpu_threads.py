"""CPU threads per process: processes x threads never exceeds the cores a run may use.

On a small machine the cost of oversubscription is large: with 2 cores, a second busy process makes a 2-thread torch
step 10-20x slower while OpenMP's threads spin at every barrier. Every process this package starts (the training
launch, the evaluation launch, the demo's stages) therefore gets `cores // local processes` threads, and OpenMP waits
passively (`OMP_WAIT_POLICY=PASSIVE`: a waiting thread sleeps instead of spinning, so it gives its core back to the
threads that have work). A user's own `OMP_NUM_THREADS` / `OMP_WAIT_POLICY` are kept.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under `taskset`; all cores where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_per_process(local_processes: int, cores: int | None = None) -> int:
    """Threads for each of `local_processes` processes on one machine: `cores // local_processes`, at least 1."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, int(local_processes)))


def launch_env(local_processes: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default `os.environ`) for processes started `local_processes` to a machine: `OMP_NUM_THREADS`
    from `threads_per_process` and `OMP_WAIT_POLICY=PASSIVE`, unless the user set them."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_process(local_processes)))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def oversubscription(env: dict[str, str], local_processes: int) -> str | None:
    """A warning when the user's `OMP_NUM_THREADS` in `env` gives `local_processes` processes more threads than there
    are usable cores, else None."""
    threads = env.get("OMP_NUM_THREADS", "")
    cores = usable_cores()
    if threads.isdigit() and local_processes * int(threads) > cores:
        return (
            f"OMP_NUM_THREADS={threads} with {local_processes} processes on {cores} usable cores: "
            f"{local_processes * int(threads)} threads oversubscribe them and every step slows down; unset it (each "
            f"process then gets {threads_per_process(local_processes)}) or lower it."
        )
    return None
