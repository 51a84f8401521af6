"""Throughput and peak memory of our trainers against stock TRL on the same data and model, for several prompt lengths.

Pairs: `SimPOGRMTrainer` vs `CPOTrainer(loss_type="simpo", cpo_alpha=0)`, `SimPODisRMTrainer` vs `RewardTrainer`.
Every (trainer, implementation, length) runs `bench/train_one.py` in a fresh process (forked from a fork server that
has imported the libraries once), so that peak RSS readings do not pollute each other; within a length the order of ours and stock alternates, so that slow drifts in the load of this
shared machine do not always favour the same side. A watchdog kills a run whose RSS passes `--mem-cap-gib` (recorded
as `over_memory_cap`) or whose wall time passes `--timeout` (recorded as `timeout`); an implementation that failed at
a length is not run at longer ones (`skipped`).

    python bench/throughput_memory.py --lengths 1024 2048 4096 --out bench/results/throughput_memory.jsonl
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402


# Imported once by the fork server: every run is a fresh process forked from it, without the ~8 s of imports.
PRELOAD = ["torch", "transformers", "datasets", "trl", "trl.experimental.cpo", "trl_longrm.trainers", "common",
           "train_one"]


def set_bench_env() -> None:
    """Environment of every benchmark process; call before the first run (the fork server inherits it).

    OpenMP threads sleep instead of spinning while they wait: on this shared 2-core machine a spinning thread whose
    partner was descheduled burns whole time slices, which made the same step take 4 s or 29 s from one run to the next.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_config(trainer: str, impl: str, length: int, cli) -> dict:
    """Run one configuration in a fresh process under the memory and time watchdog; return its result record."""
    import train_one

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    config = dict(trainer=trainer, impl=impl, prompt_length=length, response_length=cli.response_length,
                  steps=cli.steps, threads=cli.threads)
    cap = int(cli.mem_cap_gib * 2**30)
    record = {"trainer": trainer, "impl": impl, "prompt_length": length}
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp, "result.json")
        process = context.Process(target=train_one.child_entry, args=(config, str(result_path)))
        process.start()
        watched = psutil.Process(process.pid)
        peak_rss, status = 0, None
        while process.is_alive():
            try:
                peak_rss = max(peak_rss, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            if peak_rss > cap:
                status = "over_memory_cap"
            elif time.monotonic() - started > cli.timeout:
                status = "timeout"
            if status:
                process.kill()
                break
            time.sleep(0.2)
        process.join()
        result = json.loads(result_path.read_text()) if result_path.exists() else None
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    record["loadavg_1min_before"] = load_before
    record["loadavg_1min_after"] = os.getloadavg()[0]
    if status is None and result is not None and result["status"] == "ok":
        record.update(result)
        return record
    if status is None:
        # -9 without our watchdog: the kernel's OOM killer.
        status = "killed_by_system" if process.exitcode == -9 else "error"
        record["error_tail"] = (result or {}).get("error_tail", [f"exit code {process.exitcode}"])
    record["status"] = status
    record["watchdog_peak_rss_bytes"] = peak_rss
    record["mem_cap_bytes"] = cap
    record["timeout_seconds"] = cli.timeout
    return record


def describe(record: dict) -> str:
    if record["status"] != "ok":
        return f"{record['status']} after {record.get('wall_seconds', 0)} s"
    return (
        f"{record['tokens_per_s']:8.1f} tok/s  peak +{record['peak_mem_bytes'] / 2**30:5.2f} GiB "
        f"(floor +{record['floor_mem_bytes'] / 2**30:4.2f})  "
        f"steps {record['step_seconds']} s  cpu/wall {record.get('cpu_per_wall', 0):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="Prompt lengths.")
    for trainer in common.TRAINERS:
        parser.add_argument(f"--{trainer}-lengths", type=int, nargs="+", default=None,
                            help=f"Prompt lengths of the {trainer} pair, if not --lengths.")
    parser.add_argument("--trainers", nargs="+", choices=common.TRAINERS, default=list(common.TRAINERS))
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per run; the first is not timed.")
    parser.add_argument("--response-length", type=int, default=64, help="Longest response (tokens).")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's).")
    parser.add_argument("--mem-cap-gib", type=float, default=14.0, help="Kill a run whose RSS passes this.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Kill a run that takes longer (seconds).")
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines file of the results (overwritten).")
    cli = parser.parse_args()

    set_bench_env()
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    failed: dict[tuple[str, str], int] = {}
    records = []
    flip = False
    for trainer in cli.trainers:
        for length in sorted(getattr(cli, f"{trainer}_lengths") or cli.lengths):
            order = ("stock", "ours") if flip else ("ours", "stock")
            flip = not flip
            for impl in order:
                if (trainer, impl) in failed:
                    record = {
                        "trainer": trainer,
                        "impl": impl,
                        "prompt_length": length,
                        "status": "skipped",
                        "reason": f"failed at prompt length {failed[trainer, impl]}",
                    }
                else:
                    record = run_config(trainer, impl, length, cli)
                    if record["status"] != "ok":
                        failed[trainer, impl] = length
                records.append(record)
                print(f"{trainer:5s} {impl:5s} {length:6d}  {describe(record)}", flush=True)
                with cli.out.open("w") as handle:  # rewritten after every run: a killed benchmark keeps its results
                    handle.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
