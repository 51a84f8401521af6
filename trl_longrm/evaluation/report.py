"""Writing an evaluation's results: `results.json`, `results.csv`, `results.md` and the accuracy-vs-length plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from trl_longrm.evaluation.metrics import is_missing


def table_rows(results: dict) -> list[tuple[str, str, float | None, int | None]]:
    """(group, name, value, record count) rows in the order of LongRM's `results.csv`, then the extra rows.

    Example:
    ```python
    >>> rows = table_rows(results)
    >>> rows[0]
    ('task', 'LongQA', 0.75, 4)
    ```
    """
    counts = results["counts"]
    rows = [("task", task, value, counts["tasks"][task]) for task, value in results["tasks"].items()]
    rows += [
        ("subtype", "Same.", results["same"], counts["same"]),
        ("subtype", "Diff.", results["diff"], counts["diff"]),
        ("format", "PairWise Avg.", results["pairwise_avg"], counts["pairwise"]),
    ]
    rows += [("rank", f"Rank{s}", v, counts["rank"][s]) for s, v in results["rank"].items()]
    rows.append(("format", "Rank Avg.", results["rank_avg"], counts["bestofn"]))
    rows += [("length", length, v, counts["length"][length]) for length, v in results["length"].items()]
    rows.append(("overall", "AVG.", results["average"], counts["records"]))
    rows += [("rank_exact", f"Rank{s} exact", v, counts["rank"][s]) for s, v in results["rank_exact"].items()]
    rows.append(("rank_exact", "Rank Avg. exact", results["rank_exact_avg"], counts["bestofn"]))
    rows.append(("auc", f"AUC ({results['auc_source'] or 'n/a'})", results["auc"], results["auc_pairs"]))
    return rows


def _percent(value) -> str:
    return "-" if is_missing(value) else f"{100 * value:.1f}"


def markdown_table(results: dict) -> str:
    """The paper's table as Markdown (percentages), then AUC and the unparseable and truncated counts."""
    header = (
        list(results["tasks"])
        + ["Same", "Diff", "PairWise Avg"]
        + [f"Rank{s}" for s in results["rank"]]
        + ["Rank Avg"]
        + list(results["length"])
        + ["Avg"]
    )
    values = (
        list(results["tasks"].values())
        + [results["same"], results["diff"], results["pairwise_avg"]]
        + list(results["rank"].values())
        + [results["rank_avg"]]
        + list(results["length"].values())
        + [results["average"]]
    )
    auc = "-" if is_missing(results["auc"]) else f"{results['auc']:.4f}"
    lines = [
        f"# Long-RewardBench: `{results.get('model', '?')}` ({results.get('model_type', '?')})",
        "",
        "| Model | " + " | ".join(header) + " |",
        "|" + "---|" * (len(header) + 1),
        f"| {Path(str(results.get('model', '?'))).name} | " + " | ".join(_percent(v) for v in values) + " |",
        "",
        "Rank columns are LongRM's position-wise rank-match ratio; exact-order accuracy: "
        + ", ".join(f"Rank{s} {_percent(v)}" for s, v in results["rank_exact"].items())
        + f", Rank Avg {_percent(results['rank_exact_avg'])}.",
        "",
        f"- AUC: {auc} (source: {results['auc_source'] or 'none'}, {results['auc_pairs']} chosen/rejected pairs)",
        f"- Records: {results['counts']['records']} ({results['counts']['pairwise']} PairWise, "
        f"{results['counts']['bestofn']} BestOfN)",
        f"- Unparseable verdicts (counted wrong): {results['unparseable']['total']} "
        f"({results['unparseable']['PairWise']} PairWise, {results['unparseable']['BestOfN']} BestOfN)",
        f"- Inputs cut to head + tail (over max_length): {results['truncated']}",
        *(
            [f"- Verdict probabilities bounded (the server reported only its top-k tokens): {bounded}"]
            if (bounded := results.get("bounded_verdict_probs"))
            else []
        ),
        "",
    ]
    return "\n".join(lines)


def plot_length_accuracy(results: dict, path: str | Path) -> Path:
    """PNG line plot of PairWise accuracy against the context-length bucket (buckets without records are left out)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt

    points = [(length, v) for length, v in results["length"].items() if not is_missing(v)]
    fig, ax = plt.subplots(figsize=(6, 4))
    if points:
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o")
    ax.axhline(50, color="grey", linestyle="--", linewidth=1, label="chance (50%)")
    ax.legend(loc="lower left")
    ax.set_xlabel("context length")
    ax.set_ylabel("PairWise accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Long-RewardBench: {Path(str(results.get('model', ''))).name}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_reports(results: dict, save_path: str | Path, stem: str = "results") -> dict[str, Path]:
    """Write `<stem>.json`, `.csv`, `.md` and the length plot (`length_accuracy<suffix>.png`, the suffix being what
    follows `results` in `stem`) into `save_path`; returns their paths."""
    save_path = Path(save_path)
    paths = {
        "json": save_path / f"{stem}.json",
        "csv": save_path / f"{stem}.csv",
        "markdown": save_path / f"{stem}.md",
        "plot": save_path / f"length_accuracy{stem.removeprefix('results')}.png",
    }
    paths["json"].write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    with paths["csv"].open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Group", "Task", "Value", "Count"])
        for group, name, value, count in table_rows(results):
            writer.writerow(
                [group, name, "" if is_missing(value) else round(value, 5), "" if count is None else count]
            )
    paths["markdown"].write_text(markdown_table(results), encoding="utf-8")
    plot_length_accuracy(results, paths["plot"])
    return paths
