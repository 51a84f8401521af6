"""Turn the raw results of `throughput_memory.py` and `sp_scaling.py` into `results.md` (tables), `bench.png` (plots)
and `summary.json`, and print the headline ratios as one JSON line (the last line of `make bench`).

Headline ratios, each at the longest prompt length that both ours and stock trained (`null` if there is none):
`grm_tokens_per_s_ratio`, `disrm_tokens_per_s_ratio` (ours / stock, higher is better), `grm_peak_mem_ratio`,
`disrm_peak_mem_ratio` (ours / stock, lower is better); and `sp4_vs_sp1_rank_mem_ratio`, the largest per-rank peak
memory growth at ring size 4 over that at ring size 1 (first trainer of the SP run), taken from the ZeRO-3 SP run
(`sp_scaling_zero3.json`) when there is one, else from the gloo (DDP) run. `summary.json` also has, for each SP
launcher, that ratio and the same ratio of the row-dependent part (peak - floor). With `shared_prefix.json` (from
`shared_prefix.py`: ours with `shared_prefix=True` over ours with it off), `prefix_k4_groups_per_s_ratio`,
`prefix_k4_peak_mem_ratio` and `prefix_k1_groups_per_s_ratio` at its longest prompt length, the worse of GRM and DisRM.

    python bench/report.py --results bench/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


GIB = 2**30
TARGETS = {
    "grm_tokens_per_s_ratio": (">=", 1.5),
    "disrm_tokens_per_s_ratio": (">=", 1.5),
    "grm_peak_mem_ratio": ("<=", 0.5),
    "disrm_peak_mem_ratio": ("<=", 0.5),
    "sp4_vs_sp1_rank_mem_ratio": ("<=", 0.35),
    "prefix_k4_groups_per_s_ratio": (">=", 3.5),
    "prefix_k4_peak_mem_ratio": ("<=", 0.35),
    "prefix_k1_groups_per_s_ratio": (">=", 1.7),
    # The same targets on the LoRA arm (the LoRA recipes), where no full-model optimizer state sits under the peak.
    "prefix_k4_groups_per_s_ratio_lora": (">=", 3.5),
    "prefix_k4_peak_mem_ratio_lora": ("<=", 0.35),
    "prefix_k1_groups_per_s_ratio_lora": (">=", 1.7),
    # Sequence-parallel modes (`sp_modes.json`): bytes one rank receives per attention layer at 128K tokens, P = 8,
    # Ulysses over our ring (Llama-3-8B heads, from the closed form checked against counted collectives).
    "ulysses_vs_ring_bytes_p8": ("<=", 0.45),
    # LongRMReward vs TRL's reward-model path: 8 completions of 256 tokens of one 16K-token prompt.
    "reward_g8_speedup": (">=", 4.0),
    "reward_g8_peak_mem_ratio": ("<=", 0.5),
}


def load(results: Path):
    runs = [json.loads(line) for line in (results / "throughput_memory.jsonl").read_text().splitlines() if line]
    sp = []
    for name in ("sp_scaling.json", "sp_scaling_zero3.json"):
        if (results / name).exists():
            sp += json.loads((results / name).read_text())
    meta_path = results / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    prefix_path = results / "shared_prefix.json"
    meta["shared_prefix"] = json.loads(prefix_path.read_text()) if prefix_path.exists() else None
    return runs, sp, meta


def prefix_table(prefix: dict) -> list[str]:
    """Shared-prefix section: every run, then the ratios."""
    lines = ["| trainer | parameters | k | prompt | layout | row tokens | groups/s | peak GiB | floor GiB | cpu/wall |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in prefix["records"]:
        parameters = r.get("parameters", "full")
        if r["status"] != "ok":
            lines.append(f"| {r['trainer']} | {parameters} | {r['k']} | {r['prompt_length']} | "
                         f"{'shared' if r['shared_prefix'] else 'unshared'} | {r_status(r)} | | | | |")
            continue
        lines.append(f"| {r['trainer']} | {parameters} | {r['k']} | {r['prompt_length']} | "
                     f"{'shared' if r['shared_prefix'] else 'unshared'} | {r['row_tokens'][0]} | "
                     f"{r['groups_per_s']:.4f} | {r['peak_mem_bytes'] / GIB:.2f} | {r['floor_mem_bytes'] / GIB:.2f} | "
                     f"{r['cpu_per_wall']:.2f} |")
    lines += ["", "| trainer | parameters | k | prompt | groups/s shared / unshared | per CPU second | peak mem | "
              "peak - floor |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for t in prefix["summary"]["prefix_ratios"]:
        lines.append(f"| {t['trainer']} | {t.get('parameters', 'full')} | {t['k']} | {t['prompt_length']} | "
                     f"{t['groups_per_s_ratio']} | "
                     f"{t.get('groups_per_cpu_s_ratio')} | {t['peak_mem_ratio']} | {t['activation_mem_ratio']} |")
    return lines


def pairs(runs: list[dict], trainer: str) -> dict[int, dict[str, dict]]:
    """`{prompt_length: {"ours": record, "stock": record}}` of one trainer."""
    out: dict[int, dict[str, dict]] = {}
    for run in runs:
        if run["trainer"] == trainer:
            out.setdefault(run["prompt_length"], {})[run["impl"]] = run
    return dict(sorted(out.items()))


def longest_common(by_length: dict[int, dict[str, dict]]) -> int | None:
    both = [n for n, r in by_length.items() if all(r.get(i, {}).get("status") == "ok" for i in ("ours", "stock"))]
    return max(both) if both else None


def headline(runs: list[dict], sp: list[dict]) -> dict:
    summary: dict[str, object] = {}
    for trainer in ("grm", "disrm"):
        by_length = pairs(runs, trainer)
        length = longest_common(by_length)
        summary[f"{trainer}_at_prompt_length"] = length
        ours, stock = (by_length[length]["ours"], by_length[length]["stock"]) if length else ({}, {})
        summary[f"{trainer}_tokens_per_s_ratio"] = (
            round(ours["tokens_per_s"] / stock["tokens_per_s"], 3) if length else None
        )
        summary[f"{trainer}_peak_mem_ratio"] = (
            round(ours["peak_mem_bytes"] / stock["peak_mem_bytes"], 3) if length else None
        )
    ok = [r for r in sp if r["status"] == "ok"]
    first = ok[0]["trainer"] if ok else None
    by_launcher = {}
    for launcher in dict.fromkeys(r["launcher"] for r in ok):
        by_ring = {r["ring_size"]: r for r in ok if r["trainer"] == first and r["launcher"] == launcher}
        if 1 not in by_ring or 4 not in by_ring:
            continue
        one, four = by_ring[1], by_ring[4]
        by_launcher[launcher] = {
            "prompt_length": one["prompt_length"],
            "row_tokens": one["tokens_per_step"][-1],
            "ds_bucket_elements": one.get("ds_bucket_elements"),
            "peak_ratio": round(four["max_rank_peak_mem_bytes"] / one["max_rank_peak_mem_bytes"], 3),
            "row_part_ratio": round(row_part(four) / max(row_part(one), 1), 3),
            "ring1_peak_gib": round(one["max_rank_peak_mem_bytes"] / GIB, 3),
            "ring4_peak_gib": round(four["max_rank_peak_mem_bytes"] / GIB, 3),
            "ring1_floor_gib": round(one["max_rank_floor_mem_bytes"] / GIB, 3),
            "ring4_floor_gib": round(four["max_rank_floor_mem_bytes"] / GIB, 3),
        }
    headline_launcher = "zero3" if "zero3" in by_launcher else next(iter(by_launcher), None)
    summary["sp4_vs_sp1_rank_mem_ratio"] = by_launcher[headline_launcher]["peak_ratio"] if headline_launcher else None
    summary["sp_headline_launcher"] = headline_launcher
    summary["sp_trainer"] = first
    summary["sp_by_launcher"] = by_launcher
    return summary


def row_part(record: dict) -> int:
    """The row-dependent memory of a ring run: per rank peak - floor, the largest over the ranks."""
    if "max_rank_row_mem_bytes" in record:
        return max(record["max_rank_row_mem_bytes"], 0)
    return max(record["max_rank_peak_mem_bytes"] - record["max_rank_floor_mem_bytes"], 0)


def cell(record: dict | None, key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    if record is None:
        return "not run"
    if record["status"] != "ok":
        if record["status"] == "skipped":
            return f"skipped ({record['reason']})"
        if record["status"] == "over_memory_cap":
            return f"over {record['mem_cap_bytes'] / GIB:.0f} GiB cap (killed)"
        if record["status"] == "timeout":
            return f"timeout ({record['timeout_seconds']:.0f} s)"
        return record["status"]
    return fmt.format(record[key] / scale)


def ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or a["status"] != "ok" or b["status"] != "ok":
        return "-"
    return f"{a[key] / b[key]:.2f}"


def throughput_table(runs: list[dict], trainer: str) -> list[str]:
    lines = [
        "| prompt tokens | tokens/step | ours tok/s | stock tok/s | tok/s ratio | ours peak GiB | stock peak GiB "
        "| peak ratio | floor GiB (ours / stock) | cpu/wall (ours / stock) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length, row in pairs(runs, trainer).items():
        ours, stock = row.get("ours"), row.get("stock")
        done = next((r for r in (ours, stock) if r and r["status"] == "ok"), None)
        tokens = sum(done["tokens_per_step"][1:]) // len(done["tokens_per_step"][1:]) if done else "-"
        floors = " / ".join(cell(r, "floor_mem_bytes", GIB, "{:.2f}") if r and r["status"] == "ok" else "-"
                            for r in (ours, stock))
        cpu = " / ".join(f"{r['cpu_per_wall']:.2f}" if r and r["status"] == "ok" else "-" for r in (ours, stock))
        lines.append(
            f"| {length} | {tokens} | {cell(ours, 'tokens_per_s')} | {cell(stock, 'tokens_per_s')} "
            f"| {ratio(ours, stock, 'tokens_per_s')} | {cell(ours, 'peak_mem_bytes', GIB, '{:.2f}')} "
            f"| {cell(stock, 'peak_mem_bytes', GIB, '{:.2f}')} | {ratio(ours, stock, 'peak_mem_bytes')} "
            f"| {floors} | {cpu} |"
        )
    return lines


def launcher_name(record: dict) -> str:
    if record["launcher"] == "gloo":
        return "gloo (DDP)"
    buckets = record.get("ds_bucket_elements")
    return f"{record['launcher']} ({'buffers ' + str(buckets) if buckets else 'DeepSpeed default buffers'})"


def sp_table(sp: list[dict]) -> list[str]:
    lines = [
        "| trainer | launcher | ring size | row tokens | max rank peak GiB | max rank floor GiB "
        "| max rank peak - floor GiB | peak vs ring 1 | (peak - floor) vs ring 1 | step s (slowest rank) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base: dict[tuple, dict] = {}
    for r in sp:
        if r["status"] != "ok":
            lines.append(f"| {r['trainer']} | {launcher_name(r)} | {r['ring_size']} | - | {r['status']} | | | | | |")
            continue
        b = base.setdefault((r["trainer"], r["launcher"], r["prompt_length"]), r)
        peak, floor = r["max_rank_peak_mem_bytes"], r["max_rank_floor_mem_bytes"]
        lines.append(
            f"| {r['trainer']} | {launcher_name(r)} | {r['ring_size']} | {r['tokens_per_step'][-1]} | {peak / GIB:.2f} "
            f"| {floor / GIB:.2f} | {row_part(r) / GIB:.2f} | {peak / b['max_rank_peak_mem_bytes']:.2f} "
            f"| {row_part(r) / max(row_part(b), 1):.2f} | {r['timed_step_seconds']:.1f} |"
        )
    return lines


def target_lines(summary: dict) -> list[str]:
    lines = ["| ratio | value | target | met |", "|---|---:|---:|---|"]
    for key, (op, bound) in TARGETS.items():
        value = summary.get(key)
        met = "n/a" if value is None else ("yes" if (value >= bound if op == ">=" else value <= bound) else "no")
        lines.append(f"| `{key}` | {value} | {op} {bound} | {met} |")
    return lines


def modes_summary(records: list[dict]) -> dict:
    """Headline figures of `sp_scaling.py --modes ... --count-bytes` (sp_modes.json)."""
    counts = next((r["bytes_per_layer"] for r in records if "bytes_per_layer" in r), None)
    runs = {(r["mode"], r["ring_size"]): r for r in records if r.get("status") == "ok"}
    out = {}
    if counts:
        out["ulysses_vs_ring_bytes_p8"] = counts["ulysses_vs_ring_bytes_p8"]
        out["ulysses_vs_ring_bytes_p16"] = counts["ulysses_vs_ring_bytes_p16"]
    for mode in ("ulysses", "hybrid"):
        if (mode, 4) in runs and ("ring", 4) in runs:
            mine, ring = runs[mode, 4], runs["ring", 4]
            out[f"{mode}4_vs_ring4_step_time"] = round(mine["timed_step_seconds"] / ring["timed_step_seconds"], 3)
            out[f"{mode}4_vs_ring4_rank_peak_mem"] = round(
                mine["max_rank_peak_mem_bytes"] / ring["max_rank_peak_mem_bytes"], 3
            )
    return out


def modes_table(records: list[dict]) -> list[str]:
    """Sequence-parallel modes: the counted bytes per layer, the closed form at 128K, and the training runs."""
    lines = []
    counts = next((r["bytes_per_layer"] for r in records if "bytes_per_layer" in r), None)
    if counts:
        shape = counts["shape"]
        lines += [f"Bytes one rank receives per attention layer (forward + backward), {shape['heads']} query / "
                  f"{shape['kv_heads']} key-value heads of {shape['head_dim']}, {shape['dtype']}: counted from the "
                  "collectives the attention issued on gloo ranks, and the closed form "
                  "(`predicted_attention_bytes`, equal to the count at every measured size).", "",
                  "| mode | ranks | tokens | counted MiB | closed form MiB |", "|---|---:|---:|---:|---:|"]
        for row in counts["measured"]:
            lines.append(f"| {row['mode']} | {row['size']} | {row['tokens']} | {row['measured_bytes'] / 2**20:.2f} "
                         f"| {row['predicted_bytes'] / 2**20:.2f} |")
        lines += ["", "At 128K tokens (closed form, GB): " + ", ".join(
            f"{k.replace('_p', ' P=')} {v / 1e9:.2f}" for k, v in counts["predicted_128k"].items()) + ".", ""]
    runs = [r for r in records if "mode" in r]
    if runs:
        lines += ["| trainer | mode | ranks | status | timed step s | max rank peak GiB | max rank floor GiB |",
                  "|---|---|---:|---|---:|---:|---:|"]
        for r in runs:
            ok = r.get("status") == "ok"
            lines.append(
                f"| {r['trainer']} | {r['mode']} | {r['ring_size']} | {r['status']} "
                f"| {r['timed_step_seconds']:.2f} | {r['max_rank_peak_mem_bytes'] / GIB:.2f} "
                f"| {r['max_rank_floor_mem_bytes'] / GIB:.2f} |" if ok else
                f"| {r['trainer']} | {r['mode']} | {r['ring_size']} | {r['status']} | - | - | - |"
            )  # fmt: skip
        lines.append("")
    return lines


def write_markdown(path: Path, runs, sp, meta, summary) -> None:
    machine, versions = meta.get("machine", {}), meta.get("versions", {})
    out = ["# Benchmark results", ""]
    if meta:
        out += [
            f"- Command: `{meta.get('command', '?')}` (preset `{meta.get('preset', '?')}`), "
            f"{meta.get('started', '?')} to {meta.get('finished', '?')} ({meta.get('wall_minutes', '?')} min).",
            f"- Machine: {machine.get('cpu', '?')}, {machine.get('cpu_cores', '?')} cores, "
            f"{machine.get('memory_gib', '?')} GiB RAM, GPU: {machine.get('gpu') or 'none'}. Shared with other "
            f"work: 1-min load average {meta.get('loadavg_start', '?')} at start, {meta.get('loadavg_end', '?')} at end.",
            "- Software: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
            f"- Model: {meta.get('model', '?')}.",
            f"- Data: {meta.get('data', '?')}",
            "",
        ]
    out += ["## Headline (at the longest prompt length both trained)", "", *target_lines(summary), ""]
    for trainer, title in (("grm", "SimPOGRMTrainer vs stock CPOTrainer (SimPO)"),
                           ("disrm", "SimPODisRMTrainer vs stock RewardTrainer")):
        if any(r["trainer"] == trainer for r in runs):
            out += [f"## {title}", "", *throughput_table(runs, trainer), ""]
    if sp:
        sp_run = meta.get("sp_run")
        cores = (sp_run or meta).get("cpus_allowed") or machine.get("cpu_cores", "?")
        out += ["## Sequence parallelism (ring size = world size, one torch thread per rank)", ""]
        if sp_run:
            out += [f"Re-run separately: `{sp_run.get('command', '?')}`, {sp_run.get('started', '?')} to "
                    f"{sp_run.get('finished', '?')} ({sp_run.get('wall_minutes', '?')} min), load average "
                    f"{sp_run.get('loadavg_start', '?')} at start, {sp_run.get('loadavg_end', '?')} at end; "
                    f"trl_longrm {sp_run.get('versions', {}).get('trl_longrm', '?')}.", ""]
        out += [*sp_table(sp), ""]
        for launcher, values in summary.get("sp_by_launcher", {}).items():
            out.append(f"- {launcher}, {values['row_tokens']}-token row: ring 4 / ring 1 per-rank peak "
                       f"{values['peak_ratio']}, row-dependent part (peak - floor) {values['row_part_ratio']}"
                       + (" (the headline)" if launcher == summary.get("sp_headline_launcher") else "") + ".")
        out += [
            "",
            "SP memory: RSS with `MALLOC_MMAP_THRESHOLD_=65536` (glibc returns freed blocks over 64 KiB at once, so "
            "RSS follows the live tensors); floor = growth after 2 short warm-up steps (weights, gradients, AdamW "
            "state, DDP buckets / DeepSpeed partitions and buffers, and a step's transients); peak - floor = what the "
            f"row costs. All ranks share the {cores} CPU core(s) the run was allowed: step times measure "
            "oversubscription, not scaling.",
            "",
        ]
    modes = meta.get("_modes")
    if modes:
        out += ["## Sequence-parallel modes: ring, Ulysses, hybrid (`sp_scaling.py --modes ... --count-bytes`)", "",
                *modes_table(modes)]
    prefix = meta.get("_prefix")
    if prefix:
        run = prefix.get("run", {})
        out += ["## Shared prefix: ours with `shared_prefix=True` vs ours with it off (`shared_prefix.py`)", ""]
        if run:
            out += [f"Run: `{run.get('command', '?')}` (OMP_NUM_THREADS={run.get('omp_num_threads')}), "
                    f"{run.get('started', '?')} to {run.get('finished', '?')}, load average "
                    f"{run.get('loadavg_start', '?')} at start, {run.get('loadavg_end', '?')} at end"
                    + (f"; {run['note']}" if run.get("note") else "") + ".", ""]
        out += [*prefix_table(prefix), "",
                "One group (prompt + 1 chosen + k rejected responses, lengths as in the run's command) per optimizer step; groups/s "
                "over the timed steps; row tokens = tokens placed in the timed row; peak/floor as below, with glibc's "
                "mmap threshold fixed at 1 MiB in every run (RSS follows the live tensors). `full`: every parameter "
                "trained (the floor is mostly the AdamW state of the bench model's two 151,936 x 256 vocabulary "
                "matrices, the same in both layouts); `lora r=16`: the LoRA recipes' adapter.", ""]
    out += [
        "Columns: tokens are real tokens (prompt once per response plus responses, no padding); tok/s over the "
        "timed steps (all but the short warm-up step); peak = growth of the peak RSS over the RSS after the model "
        "build; floor = the same after the warm-up step (gradients, AdamW state: independent of the row); cpu/wall = "
        "CPU seconds per wall second of the timed steps (2 = both cores ours; lower = other processes took cores).",
        "",
    ]
    path.write_text("\n".join(out))


def plot(path: Path, runs: list[dict], sp: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator, ScalarFormatter

    panels = 3 if sp else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.3))
    styles = {("grm", "ours"): ("tab:blue", "-o"), ("grm", "stock"): ("tab:blue", "--s"),
              ("disrm", "ours"): ("tab:orange", "-o"), ("disrm", "stock"): ("tab:orange", "--s")}
    names = {"grm": "GRM (SimPO)", "disrm": "DisRM (BT)"}
    for ax, key, scale, label in ((axes[0], "tokens_per_s", 1, "trained tokens / s"),
                                  (axes[1], "peak_mem_bytes", GIB, "peak RSS growth (GiB)")):
        for (trainer, impl), (color, style) in styles.items():
            by_length = pairs(runs, trainer)
            ok = [(n, r[impl][key] / scale) for n, r in by_length.items() if r.get(impl, {}).get("status") == "ok"]
            if ok:
                ax.plot(*zip(*ok), style, color=color, label=f"{names[trainer]} {impl}")
            failed = [n for n, r in by_length.items() if r.get(impl, {}).get("status") not in ("ok", "skipped", None)]
            for n in failed:
                ax.axvline(n, color=color, linestyle=":", alpha=0.6)
                ax.annotate(f"{impl} {r_status(by_length[n][impl])}", (n, ax.get_ylim()[1] * 0.9), rotation=90,
                            fontsize=7, color=color, ha="right", va="top")
        lengths = sorted({r["prompt_length"] for r in runs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        if key == "tokens_per_s":
            ax.set_yscale("log")  # GRM stock and DisRM differ by 20x
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_locator(NullLocator())
            ax.set_yticks([t for t in (50, 100, 200, 500, 1000, 2000, 5000, 10000)
                           if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]])
        ax.set_xlabel("prompt tokens (row = 2 x prompt + responses)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title("Throughput, ours vs stock TRL")
    axes[1].set_title("Peak memory, ours vs stock TRL")
    if sp:
        ax = axes[2]
        ok = [r for r in sp if r["status"] == "ok"]
        series = list(dict.fromkeys((r["trainer"], r["launcher"], r["prompt_length"]) for r in ok))
        colors = {"gloo": "tab:blue", "zero2": "tab:green", "zero3": "tab:purple"}
        for i, key in enumerate(series):
            rows = [r for r in ok if (r["trainer"], r["launcher"], r["prompt_length"]) == key]
            x = [r["ring_size"] + (i - (len(series) - 1) / 2) * 0.3 for r in rows]
            floor = [r["max_rank_floor_mem_bytes"] / GIB for r in rows]
            row = [row_part(r) / GIB for r in rows]
            color = colors.get(key[1], "tab:gray")
            label = f"{names[key[0]]}, {launcher_name(rows[0])}, {rows[0]['tokens_per_step'][-1]}-token row"
            ax.bar(x, floor, width=0.28, color=color, alpha=0.35, label=f"{label}: floor")
            ax.bar(x, row, width=0.28, bottom=floor, color=color, label=f"{label}: peak - floor")
            for xi, f, r in zip(x, floor, row):
                ax.annotate(f"{f + r:.2f}", (xi, f + r), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(sorted({r["ring_size"] for r in ok}))
        cores = meta.get("sp_run", meta).get("cpus_allowed") or meta.get("machine", {}).get("cpu_cores", "?")
        ax.set_xlabel(f"ring size = world size (processes on {cores} CPU core(s))")
        ax.set_ylabel("largest per-rank peak RSS growth (GiB)")
        ax.legend(fontsize=6)
        ax.set_ylim(0, max(r["max_rank_peak_mem_bytes"] for r in ok) / GIB * 1.6)
        ax.set_title("Sequence parallelism: per-rank memory")
        ax.grid(alpha=0.3, axis="y")
    versions = meta.get("versions", {})
    fig.suptitle(
        f"trl_longrm vs TRL {versions.get('trl', '?')} on CPU ({meta.get('machine', {}).get('cpu_cores', '?')} cores), "
        f"torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}; "
        f"{meta.get('model', '')}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def r_status(record: dict) -> str:
    return {"over_memory_cap": "over memory cap", "timeout": "timeout"}.get(record["status"], record["status"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, required=True, help="Directory with the raw results.")
    cli = parser.parse_args()
    runs, sp, meta = load(cli.results)
    summary = headline(runs, sp)
    prefix = meta.pop("shared_prefix", None)
    if prefix:
        summary.update({k: v for k, v in prefix["summary"].items()})
    meta["_prefix"] = prefix
    modes_path = cli.results / "sp_modes.json"
    meta["_modes"] = json.loads(modes_path.read_text()) if modes_path.exists() else None
    if meta["_modes"]:
        summary.update(modes_summary(meta["_modes"]))
    reward_path = cli.results / "reward_function.json"
    if reward_path.exists():  # bench/reward_function.py
        reward = json.loads(reward_path.read_text())
        summary.update({k: reward[k] for k in ("reward_g8_speedup", "reward_g8_peak_mem_ratio")})
    write_markdown(cli.results / "results.md", runs, sp, meta, summary)
    plot(cli.results / "bench.png", runs, sp, meta)
    (cli.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    keys = [k for k in TARGETS]
    print(json.dumps({k: summary.get(k) for k in keys}), flush=True)


if __name__ == "__main__":
    main()
