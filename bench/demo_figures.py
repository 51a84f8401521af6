"""The figures of `make demo` as a newcomer gets them, on both CPU kernel profiles, and the tables README.md and
docs/demo.md quote (generated from the record, never typed).

Each profile runs exactly what `make demo` runs (`python -m trl_longrm.demo --output-dir DIR`, seed 0, every default)
in a fresh interpreter: `native` is whatever this machine picks, `avx2` forces the AVX2 kernels a machine without
AVX-512 uses (`bench/demo_seeds.py` says why the figures differ). The demo's targets (issue 43): DisRM >= 90% PairWise,
judge >= 85% after SFT, stage II >= stage I, in <= 15 minutes on a 2-core AVX2 machine.

    .venv/bin/python bench/demo_figures.py --out bench/results/demo_figures.json --docs   # both profiles, ~9 min
    .venv/bin/python bench/demo_figures.py --docs --from bench/results/demo_figures.json  # tables only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_seeds import PROFILES  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"simpo_disrm": 0.90, "sft": 0.85, "wall_s_avx2": 15 * 60}
# Where the generated table goes: between these markers of each file.
MARKERS = ("<!-- demo-figures -->", "<!-- /demo-figures -->")
DOC_FILES = (ROOT / "README.md", ROOT / "docs" / "demo.md")
ROWS = (
    ("disrm", "DisRM base (random init)"),
    ("simpo_disrm", "DisRM trained (ring of 2)"),
    ("judge", "judge base (DisRM backbone)"),
    ("sft", "judge after SFT"),
    ("simpo_grm", "judge after SimPO"),
)


def run_profile(output_dir: Path, profile: str) -> dict:
    """`make demo`'s command in a fresh interpreter under `profile` (torch reads the kernel profile at start)."""
    code = (
        "import json, sys, torch; from trl_longrm.demo import main; main(['--output-dir', sys.argv[1]]);"
        "print('CAPABILITY', torch.backends.cpu.get_cpu_capability())"
    )
    env = {**os.environ, **PROFILES[profile], "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code, str(output_dir)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if result.returncode:
        sys.stderr.write(result.stderr[-5000:])
        raise SystemExit(f"make demo's command failed under profile {profile} in {output_dir}")
    capability = next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("CAPABILITY"))
    summary = json.loads((output_dir / "summary.json").read_text(encoding="utf-8"))
    return {
        "profile": profile,
        "capability": capability,
        "wall_s": round(wall),
        "models": {
            name: {key: row[key] for key in ("pairwise_avg", "auc", "unparseable", "records")}
            for name, row in summary["models"].items()
        },
        "timings_s": summary["timings_s"],
    }


def verdict(run: dict) -> dict:
    """Each target of the demo met or not, for one profile's run."""
    models = run["models"]
    checks = {
        "disrm_at_least_90": models["simpo_disrm"]["pairwise_avg"] >= TARGETS["simpo_disrm"],
        "judge_after_sft_at_least_85": models["sft"]["pairwise_avg"] >= TARGETS["sft"],
        "stage_ii_at_least_stage_i": models["simpo_grm"]["pairwise_avg"] >= models["sft"]["pairwise_avg"],
    }
    if run["profile"] == "avx2":
        checks["within_15_min"] = run["wall_s"] <= TARGETS["wall_s_avx2"]
    return checks


def render_table(record: dict) -> str:
    """The Markdown table of both profiles (what README.md and docs/demo.md show between the markers)."""
    runs = record["runs"]
    header = ["PairWise % (AUC)", *(f"{r['profile']} ({r['capability']})" for r in runs)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, label in ROWS:
        cells = []
        for run in runs:
            row = run["models"].get(name)
            auc = "" if row is None or row["auc"] is None else f" ({row['auc']:.3f})"
            cells.append("-" if row is None else f"{100 * row['pairwise_avg']:.1f}{auc}")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    minutes = [f"{r['wall_s'] // 60} min {r['wall_s'] % 60:02d} s" for r in runs]
    lines.append("| " + " | ".join(["time (2 cores)", *minutes]) + " |")
    return (
        "\n".join(lines)
        + f"\n\n`make demo` (seed 0), commit {record['commit']}, {record['date']}: `{record['command']}`.\n"
    )


def write_docs(record: dict, files=DOC_FILES) -> None:
    table = render_table(record)
    for path in files:
        text = path.read_text(encoding="utf-8")
        start, end = (text.index(marker) for marker in MARKERS)
        path.write_text(text[: start + len(MARKERS[0])] + "\n" + table + text[end:], encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", choices=list(PROFILES), default=list(PROFILES))
    parser.add_argument("--out", default=None, help="Write the JSON record here.")
    parser.add_argument("--from", dest="source", default=None, help="Render the tables of this record; run nothing.")
    parser.add_argument("--docs", action="store_true", help="Write the table into README.md and docs/demo.md.")
    args = parser.parse_args()
    if args.source:
        record = json.loads(Path(args.source).read_text(encoding="utf-8"))
    else:
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
        dirty = git("status", "--porcelain", "--", "trl_longrm", "recipes")
        runs = []
        with tempfile.TemporaryDirectory(prefix="demo_figures_") as work:
            for profile in args.profiles:
                runs.append(run_profile(Path(work) / profile, profile))
                runs[-1]["targets_met"] = verdict(runs[-1])
                print(json.dumps(runs[-1]), flush=True)
        record = {
            "command": "python bench/demo_figures.py " + " ".join(sys.argv[1:]),
            "commit": git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else ""),
            "date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} cores",
            "targets": TARGETS,
            "runs": runs,
        }
        if args.out:
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if args.docs:
        write_docs(record)
    print(render_table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
