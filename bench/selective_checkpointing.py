"""Selective checkpointing (`gradient_checkpointing_kwargs={"selective": True}`) on CPU: peak tensor memory and time of
a training step, with plain gradient checkpointing and with selective checkpointing, side by side in one run. The
setup of `tiled_mlp.py` (our SimPO-GRM trainer, one process, one group of a long prompt per step, the benchmark model
with intermediate 3.5x hidden); each run in its own processes, peak from a profiled run, time the median step of an
unprofiled one.

    python bench/selective_checkpointing.py --out bench/results/selective_checkpointing.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tiled_mlp import parse_or_work, report_header, side_by_side  # noqa: E402


RUNS = {
    "plain": {"gradient_checkpointing": True},
    "selective": {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"selective": True}},
}


def main() -> None:
    cli = parse_or_work(__doc__, str(HERE / "results" / "selective_checkpointing.json"))
    if cli is None:
        return
    results, peak, step = side_by_side(__file__, cli.prompt_length, cli.steps, RUNS)
    report = {
        **report_header(cli),
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
