"""The ablation the method implies (issue 62): the data demo's pipeline (`trl_longrm.data_demo`: short synthetic
records -> long prompts -> responses -> five judges -> consensus voting -> SFT -> SimPO) against the same pipeline with
each row's chosen judgment (and SFT target) replaced by a random one of its judges' judgments. Same records, responses,
judgments, base models and steps; only the choice of the chosen judgment differs. Reports each stage's PairWise
accuracy and AUC on the held-out mini benchmark, and the margin (voted - random).

    .venv/bin/python bench/data_pipeline.py --out bench/results/data_pipeline.json          # reduced size, seed 0
    .venv/bin/python bench/data_pipeline.py --full --out bench/results/data_pipeline_full.json

Each arm is a whole data demo in a fresh interpreter (about 4-5 minutes on 2 cores at the reduced size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_arm(output_dir: Path, chosen: str, seed: int, full: bool) -> dict:
    code = (
        "import json, sys;"
        "from trl_longrm.data_demo import SMALL_DATA_DEMO, DataDemoConfig, run_data_demo;"
        "size = {} if sys.argv[4] == 'full' else SMALL_DATA_DEMO;"
        "s = run_data_demo(DataDemoConfig(output_dir=sys.argv[1], chosen=sys.argv[2], seed=int(sys.argv[3]), **size));"
        "print('SUMMARY', json.dumps(s))"
    )
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code, str(output_dir), chosen, str(seed), "full" if full else "small"],
        capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )  # fmt: skip
    if result.returncode:
        sys.stderr.write(result.stderr[-5000:])
        raise SystemExit(f"the data demo failed ({chosen}) in {output_dir}")
    summary = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("SUMMARY"))[8:])
    return {
        "chosen": chosen,
        "wall_s": round(time.perf_counter() - start),
        "pairwise": {name: row["pairwise_avg"] for name, row in summary["models"].items()},
        "auc": {name: row["auc"] for name, row in summary["models"].items()},
        "unparseable": {name: row["unparseable"] for name, row in summary["models"].items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the results.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full", action="store_true", help="The data demo's default size, not the reduced one.")
    parser.add_argument("--work-dir", type=Path, default=None, help="Where the two demos run (default: a temp dir).")
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="data_pipeline_"))
    arms = [run_arm(work / chosen, chosen, args.seed, args.full) for chosen in ("voted", "random")]
    for arm in arms:
        print(json.dumps(arm), flush=True)
    voted, rand = arms
    margin = {stage: round(100 * (voted["pairwise"][stage] - rand["pairwise"][stage]), 1)
              for stage in voted["pairwise"] if stage in ("sft", "simpo_grm")}  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"seed": args.seed, "size": "full" if args.full else "reduced", "commit": commit, "arms": arms,
              "margin_points": margin}  # fmt: skip
    print("| PairWise % (AUC) | voted chosen | random chosen | margin (points) |")
    print("|---|---|---|---|")
    for stage in voted["pairwise"]:
        cells = [f"{100 * arm['pairwise'][stage]:.1f} ({arm['auc'][stage]:.3f})" for arm in arms]
        print(f"| {stage} | {cells[0]} | {cells[1]} | {margin.get(stage, '-')} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
