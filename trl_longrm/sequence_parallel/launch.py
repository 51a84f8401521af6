"""Run a function on N local gloo processes (CPU): the multi-process tests and small experiments use it."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_distributed_env(rank: int, world_size: int) -> None:
    """Export the torchrun variables of a local gloo rank, so that accelerate (and so a Trainer) built inside a
    `run_on_gloo_ranks` worker joins the process group that is already initialised instead of starting its own."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",
        OMP_NUM_THREADS="1",
    )


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple, num_threads: int) -> None:
    # Each process gets few threads: the workers share the machine's cores.
    torch.set_num_threads(num_threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 300.0,
    num_threads: int = 1,
    preload: Sequence[str] = (),
) -> None:
    """Spawn `world_size` processes joined in a gloo group on 127.0.0.1 and run `fn(rank, world_size, *args)` in each.

    `fn` must be importable by name (a module-level function). An exception in any process is raised here with its
    traceback; processes still running after `timeout` seconds are terminated and a `TimeoutError` is raised.
    The workers are forked from a fork server that imports torch and the `preload` modules once; `preload` only
    counts when this process starts its fork server (its first launch), so pass the same list on every call.

    Example:
    ```python
    >>> def worker(rank, world_size):
    ...     assert torch.distributed.get_world_size() == world_size
    >>> run_on_gloo_ranks(worker, 2)
    ```
    """
    port = find_free_port()
    # A fork server that imported torch once forks every worker: far cheaper than a fresh interpreter per worker
    # (spawn), and safe, unlike forking a parent whose OpenMP thread pool may already be running.
    mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", __name__, *preload])
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, port, args, num_threads),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} gloo ranks ran past {timeout} s.")
