"""Selective checkpointing (`gradient_checkpointing_kwargs={"selective": True}`) on CPU: peak tensor memory and time of
a training step, with plain gradient checkpointing and with selective checkpointing, side by side in one run. The
setup of `tiled_mlp.py` (our SimPO-GRM trainer, one process, one group of a long prompt per step, the benchmark model
with intermediate 3.5x hidden); each run in its own processes, peak from a profiled run, time the median step of an
unprofiled one.

    python bench/selective_checkpointing.py --out bench/results/selective_checkpointing.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from tiled_mlp import INTERMEDIATE_SIZE, run, side_by_side  # noqa: E402


RUNS = {
    "plain": {"gradient_checkpointing": True},
    "selective": {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"selective": True}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-length", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "selective_checkpointing.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one run, its JSON on stdout
    cli = parser.parse_args()
    if cli.worker:
        settings, profile = json.loads(cli.worker)
        print("RESULT " + json.dumps(run(cli.prompt_length, settings, cli.steps, profile)))
        return
    results, peak, step = side_by_side(__file__, cli.prompt_length, cli.steps, RUNS)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": common.software_versions(),
        "machine": common.machine_description(),
        "model": {**common.MODEL_OVERRIDES, "intermediate_size": INTERMEDIATE_SIZE, "arch": common.ARCH},
        "prompt_length": cli.prompt_length,
        "runs": results,
        "summary": {
            "peak_mib_plain": round(peak["plain"] / 2**20, 1),
            "peak_mib_selective": round(peak["selective"] / 2**20, 1),
            "peak_ratio_selective_vs_plain": round(peak["selective"] / peak["plain"], 3),
            "step_seconds_plain": round(step["plain"], 3),
            "step_seconds_selective": round(step["selective"], 3),
            "step_time_ratio_selective_vs_plain": round(step["selective"] / step["plain"], 3),
        },
    }
    Path(cli.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"]))


if __name__ == "__main__":
    main()
