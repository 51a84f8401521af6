"""The demo beside a busy neighbour: a reduced `make demo`, run quiet and then with one CPU-bound process beside it,
and the ratio of their wall times per stage (issue 19's target: at most 2x).

Every stage of the demo sets its threads from the cores it may use (`trl_longrm.cpu_threads`: the ring stage's 2
processes 1 thread each, the single-process stages and the evaluations all cores) and waits passively
(`OMP_WAIT_POLICY=PASSIVE`), so a neighbour costs the demo its share of the cores rather than the 10-20x of threads
spinning against each other. The neighbour is a pure-Python busy loop (one core's worth of work, no threads).

    .venv/bin/python bench/demo_under_load.py --out bench/results/demo_under_load.json

Prints one JSON line: wall seconds per stage, quiet and loaded, and their ratios. The two runs use separate output
directories of the same settings, so they do the same work (their results are printed too: they must be equal).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


# A reduced demo: the whole pipeline in a few minutes (900 DisRM groups = 112 steps on the ring, 300 SFT steps, 50
# SimPO steps). The learning is not the point here; the work per stage is.
REDUCED = dict(num_train=900, train_overrides={"sft": ["--max_steps", "300"], "simpo_grm": ["--max_steps", "50"]})


def busy_loop(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x = (x * 31 + 7) % 1_000_003


def run_demo_once(root: Path) -> tuple[float, dict]:
    # In a fresh interpreter, as `make demo` runs it: torch starts OpenMP with the demo's settings.
    import subprocess

    code = (
        "import json, os, sys; os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE');"
        "from trl_longrm.demo import DemoConfig, run_demo;"
        f"s = run_demo(DemoConfig(output_dir={str(root)!r}, **json.loads(sys.argv[1])));"
        "print('SUMMARY', json.dumps(s))"
    )
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(REDUCED)], capture_output=True, text=True, env=dict(os.environ)
    )
    wall = time.perf_counter() - start
    if result.returncode:
        sys.stderr.write(result.stderr[-5000:])
        raise SystemExit(f"demo failed in {root}")
    summary = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("SUMMARY"))[8:])
    return wall, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="Write the JSON record here too.")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="demo_under_load_"))
    try:
        quiet_wall, quiet = run_demo_once(work / "quiet")
        neighbour = multiprocessing.Process(target=busy_loop, args=(time.time() + 4 * quiet_wall + 600,), daemon=True)
        neighbour.start()
        try:
            loaded_wall, loaded = run_demo_once(work / "loaded")
        finally:
            neighbour.terminate()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stages = {
        name: {
            "quiet_s": quiet["timings_s"][name],
            "loaded_s": loaded["timings_s"][name],
            "ratio": round(loaded["timings_s"][name] / max(quiet["timings_s"][name], 1e-9), 2),
        }
        for name in quiet["timings_s"]
    }
    record = {
        "command": "python bench/demo_under_load.py",
        "settings": REDUCED,
        "cores": len(os.sched_getaffinity(0)),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE (set by the demo)"),
        "quiet_wall_s": round(quiet_wall, 1),
        "loaded_wall_s": round(loaded_wall, 1),
        "ratio": round(loaded_wall / quiet_wall, 2),
        "stages": stages,
        "same_results": quiet["models"] == loaded["models"],
        "pairwise": {name: row["pairwise_avg"] for name, row in quiet["models"].items()},
    }
    line = json.dumps(record)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
