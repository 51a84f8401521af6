"""The memory plans of the paper's shapes, published: Qwen3-8B (GRM, SFT) and Llama-3.1-8B (DisRM), full parameters
and LoRA, 1 and 8 x 80 GB, ring / Ulysses / hybrid, ZeRO-2 / ZeRO-3; for each, the predicted per-rank peak of a group
at the recipes' `max_length` of 131,072 tokens (a prompt of 129,024 and 1 + 4 responses of 2,048; SFT: one example of
131,072 tokens), and (with `--longest`) the longest prompt that fits an H100 80 GB (the 79.15 GiB a process gets on it:
`trl_longrm.memory_plan.devices`);
stock TRL's trainers (RewardTrainer, CPOTrainer, SFTTrainer) planned the same way on the same shapes, side by side.

Every case is a recipe of `recipes/` with command-line overrides, planned exactly as `trl-longrm train RECIPE --dry_run
--plan_longest_group true` plans it (`trl_longrm.memory_plan.recipe.recipe_memory_plans`), on the CUDA terms (the
recipes' accelerate configs name GPUs). Results are cached per case in the output JSON (a rerun traces only the cases
missing, or those named by `--only`), so a long run resumes where it stopped.

    python bench/memory_plan.py --out bench/results/memory_plan.json            # peaks at 131,072 tokens
    python bench/memory_plan.py --out bench/results/memory_plan.json --longest  # and the longest groups
    python bench/memory_plan.py --table bench/results/memory_plan.json          # the Markdown table only

The summary keys (`summary` in the JSON) are the longest prompts of the named cases (tokens, k = 4 rejected responses
of 2,048 tokens) and their ratios to stock's on the same GPUs, plus `plan_vs_measured_max_rel_error_cpu`: the largest
relative error of the plan against the measured peak over the validation cases of `tests/test_memory_plan.py`
(`--validate` runs them and records each comparison they assert).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
MAX_LENGTH = 131_072
RESPONSE_TOKENS = 2_048
NUM_REJECTED = 4


@dataclass(frozen=True)
class Case:
    """One plan: a recipe, the overrides of its layout, and whether stock TRL's trainer is planned instead."""

    name: str
    recipe: str
    overrides: tuple[str, ...] = ()
    stock: bool = False
    longest: bool = True
    notes: str = ""
    max_length: int = MAX_LENGTH

    def argv(self) -> list[str]:
        # `max_length` bounds the longest sequence (prompt + one response): the planned prompt is what it leaves.
        shape = ["--max_length", str(self.max_length), "--plan_response_tokens", str(RESPONSE_TOKENS),
                 "--plan_num_rejected", str(NUM_REJECTED)]  # fmt: skip
        if not self.recipe.startswith("sft"):
            # The plan's group is at most the trainer's `num_rejected` (the recipes train on the paper's V = 2): the
            # planned rows keep LongRM's 1 + 4 judgments.
            shape += ["--num_rejected", str(NUM_REJECTED)]
        return [str(ROOT / "recipes" / self.recipe), *shape, *self.overrides, "--dry_run", "true"]


def _layout(mode: str, sp: int, zero: int, processes: int = 8, ulysses: int | None = None) -> tuple[str, ...]:
    values = ["--num_processes", str(processes), "--accelerate_config", f"zero{zero}.yaml",
              "--sequence_parallel_size", str(sp), "--sequence_parallel_mode", mode]  # fmt: skip
    if ulysses:
        values += ["--ulysses_size", str(ulysses)]
    if mode == "ulysses":
        values += ["--ring_head_stride", "1"]  # each rank holds 8 / 8 = 1 key/value head after the exchange
    return tuple(values)


FULL = ("--use_peft", "false")  # the DisRM recipes train LoRA adapters (the paper's); full parameters otherwise
ONE_GPU = ("--num_processes", "1", "--accelerate_config", "single_gpu.yaml", "--sequence_parallel_size", "1")
# Stock holds whole rows on every rank: the same processes, every one data parallel.
STOCK_8 = ("--num_processes", "8", "--accelerate_config", "zero3.yaml", "--sequence_parallel_size", "1")

# The long-row settings of the `*_1m.yaml` recipes (docs/memory.md): checkpointed inputs offloaded to host memory, the
# MLP over slices of 16,384 tokens, keys/values gathered one head at a time.
LONG_ROWS = ("--gradient_checkpointing_kwargs", '{"use_reentrant": false, "offload": true}', "--mlp_tile_tokens",
             "16384", "--ring_head_stride", "1")  # fmt: skip
MILLION = 1_048_576

CASES = [
    # The long-row cases of the summary (and of issue 41's targets) first: they take the longest to plan.
    Case("grm_qwen3_8b_full_8x80_ring_zero3_long", "simpo_grm_1m.yaml", (), max_length=MILLION,
         notes="recipes/simpo_grm_1m.yaml"),
    Case("stock_cpo_qwen3_8b_full_8x80_zero3_long", "simpo_grm_1m.yaml", STOCK_8, stock=True),
    Case("grm_qwen3_8b_full_8x80_ring_zero3_2m", "simpo_grm_1m.yaml", (), max_length=2 * MILLION + RESPONSE_TOKENS,
         longest=False, notes="recipes/simpo_grm_1m.yaml at a 2,097,152-token prompt (issue 41; its longest: the "
                              "first case's)"),
    Case("disrm_llama31_8b_lora_1x80_long", "simpo_disrm_lora.yaml", ONE_GPU + LONG_ROWS, max_length=MILLION // 2),
    Case("stock_reward_llama31_8b_lora_1x80_long", "simpo_disrm_lora.yaml", ONE_GPU + LONG_ROWS, stock=True),
    Case("sft_qwen3_8b_full_8x80_ring_zero3_1m", "sft_1m.yaml", (), max_length=MILLION, notes="recipes/sft_1m.yaml"),
    Case("disrm_llama31_8b_lora_8x80_ring_zero3_1m", "simpo_disrm_1m.yaml", (), max_length=MILLION,
         notes="recipes/simpo_disrm_1m.yaml"),
    Case("stock_sft_qwen3_8b_full_8x80_zero3_long", "sft_1m.yaml", STOCK_8, stock=True),
    # Generative RM (stage II, SimPO), Qwen3-8B.
    Case("grm_qwen3_8b_full_8x80_ring_zero2", "simpo_grm.yaml", _layout("ring", 8, 2), notes="the paper recipe"),
    Case("grm_qwen3_8b_full_8x80_ring_zero3", "simpo_grm.yaml", _layout("ring", 8, 3)),
    Case("grm_qwen3_8b_full_8x80_ulysses_zero3", "simpo_grm.yaml", _layout("ulysses", 8, 3)),
    Case("grm_qwen3_8b_full_8x80_hybrid2x4_zero3", "simpo_grm.yaml", _layout("hybrid", 8, 3, ulysses=2)),
    Case("grm_qwen3_8b_lora_8x80_ring_zero2", "simpo_grm_lora.yaml", _layout("ring", 8, 2)),
    Case("grm_qwen3_8b_lora_1x80", "simpo_grm_lora.yaml", ONE_GPU),
    Case("stock_cpo_qwen3_8b_full_8x80_zero3", "simpo_grm.yaml", STOCK_8, stock=True),
    Case("stock_cpo_qwen3_8b_lora_1x80", "simpo_grm_lora.yaml", ONE_GPU, stock=True),
    # Discriminative RM (Bradley-Terry), Llama-3.1-8B.
    Case("disrm_llama31_8b_full_8x80_ring_zero3", "simpo_disrm.yaml", _layout("ring", 8, 3) + FULL),
    Case("disrm_llama31_8b_full_8x80_ulysses_zero3", "simpo_disrm.yaml", _layout("ulysses", 8, 3) + FULL),
    Case("disrm_llama31_8b_lora_8x80_ring_zero2", "simpo_disrm.yaml", _layout("ring", 8, 2), notes="the paper recipe"),
    Case("disrm_llama31_8b_lora_1x80", "simpo_disrm_lora.yaml", ONE_GPU),
    Case("stock_reward_llama31_8b_full_8x80_zero3", "simpo_disrm.yaml", STOCK_8 + FULL, stock=True),
    Case("stock_reward_llama31_8b_lora_1x80", "simpo_disrm_lora.yaml", ONE_GPU, stock=True),
    # SFT of the judge (stage I), Qwen3-8B: one example of 131,072 + 2,048 tokens a row.
    Case("sft_qwen3_8b_full_8x80_ring_zero2", "sft.yaml", _layout("ring", 8, 2), notes="the paper recipe"),
    Case("sft_qwen3_8b_full_8x80_ulysses_zero3", "sft.yaml", _layout("ulysses", 8, 3)),
    Case("sft_qwen3_8b_lora_1x80", "sft_lora.yaml", ONE_GPU),
    Case("stock_sft_qwen3_8b_full_8x80_zero3", "sft.yaml", STOCK_8, stock=True),
    Case("stock_sft_qwen3_8b_lora_1x80", "sft_lora.yaml", ONE_GPU, stock=True),
]

# summary key -> (our case, stock case): the longest prompt of ours, and ours / stock's.
SUMMARY = {
    "grm_qwen3_8b": ("grm_qwen3_8b_full_8x80_ring_zero3_long", "stock_cpo_qwen3_8b_full_8x80_zero3_long"),
    "disrm_llama31_8b_lora": ("disrm_llama31_8b_lora_1x80_long", "stock_reward_llama31_8b_lora_1x80_long"),
}
# summary key -> case: its predicted peak (GiB) at its recipe's length.
PEAKS = {"sft_1m_8x80_peak_gib": "sft_qwen3_8b_full_8x80_ring_zero3_1m",
         "grm_2m_8x80_peak_gib": "grm_qwen3_8b_full_8x80_ring_zero3_2m"}


def plan_case(case: Case, longest: bool) -> dict:
    """The case's plan summary (`recipe_memory_plans`' data), with its wall time and resident memory."""
    import resource

    from trl_longrm.memory_plan.recipe import recipe_memory_plans
    from trl_longrm.train import parse_args, training_plan

    argv = [*case.argv(), "--plan_longest_group", "true" if longest and case.longest else "false"]
    commit = _commit()  # the code this case is planned with (read now: a long case may outlive the commit)
    started = time.perf_counter()
    script_args, training_args, model_args = parse_args(argv, check_only=True)
    world_size = training_plan(script_args, training_args, model_args)["world_size"]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        summary, text = recipe_memory_plans(script_args, training_args, model_args, world_size,
                                            ROOT / "recipes", stock=case.stock)  # fmt: skip
    if summary is None:
        raise RuntimeError(f"{case.name}: {text}")
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["max_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    summary["argv"] = ["recipes/" + case.recipe, *argv[1:]]
    summary["text"] = text
    summary["notes"] = case.notes
    summary["world_size"] = world_size
    summary["commit"] = commit
    return summary


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def run_one(case: Case, longest: bool) -> dict:
    """`plan_case` in a fresh process: each plan sets up (and tears down) a fake process group and accelerate's state,
    and each process's resident memory is the case's own."""
    command = [sys.executable, __file__, "--case", case.name, *(["--longest"] if longest else [])]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in result.stdout.splitlines() if line.startswith("@@")]
    if result.returncode or not lines:
        raise RuntimeError(f"{case.name} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(lines[-1][2:])


def longest_prompt(entry: dict | None) -> int | None:
    found = (entry or {}).get("longest_group")
    return found["prompt_tokens"] if found else None


def validate() -> dict:
    """Run the plan-vs-measured tests of `tests/test_memory_plan.py` (CPU, one process and gloo groups of 2) and
    collect each comparison they make."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp) / "records.jsonl"
        env = {**os.environ, "TRL_LONGRM_MEMORY_PLAN_RESULTS": str(records)}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_memory_plan.py", "-k",
                   "matches_measured_peak"]  # fmt: skip
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        lines = records.read_text().splitlines() if records.exists() else []
    cases = [json.loads(line) for line in lines]
    if not cases:
        raise RuntimeError(f"the validation tests recorded nothing:\n{result.stdout[-3000:]}")
    return {
        "commit": _commit(),
        "command": " ".join(["pytest", *command[command.index("tests/test_memory_plan.py"):]]),
        "tests_passed": result.returncode == 0,
        "pytest_summary": result.stdout.strip().splitlines()[-1],
        "cases": cases,
        "max_rel_error": round(max(abs(c["rel_error"]) for c in cases), 4),
    }


def summarize(results: dict, validation: dict | None) -> dict:
    summary = {}
    if validation:
        summary["plan_vs_measured_max_rel_error_cpu"] = validation["max_rel_error"]
    for key, (ours, stock) in SUMMARY.items():
        gpus = "8x80" if "8x80" in ours else "1x80"
        a, b = longest_prompt(results.get(ours)), longest_prompt(results.get(stock))
        summary[f"longest_group_{gpus}_{key}"] = a
        summary[f"longest_group_ratio_vs_stock_{key.split('_')[0]}"] = round(a / b, 2) if a and b else None
    for key, case in PEAKS.items():
        summary[key] = results[case]["peak_gib"] if case in results else None
    return summary


def table(results: dict) -> str:
    """The Markdown table of README / docs: one line per case."""
    lines = [
        "| case | trainer | GPUs | layout | longest sequence (tokens) | peak per rank (GiB) | host per machine (GiB) | "
        "fits the card | longest prompt that fits (tokens) |",
        "|---|---|---|---|---:|---:|---:|---|---:|",
    ]
    for case in CASES:
        entry = results.get(case.name)
        if entry is None:
            continue
        rank = entry["ranks"][-1]
        sp = rank["sequence_parallel_size"]
        if sp > 1:
            layout = f"{rank['sequence_parallel_mode']} {sp}, {rank['distributed']}"
        else:
            layout = rank["distributed"]
        longest = entry.get("longest_group")
        longest_text = "-" if longest is None else (f"{longest['prompt_tokens']:,}" if longest["prompt_tokens"] else "none")
        lora = "LoRA" if rank["trainable_parameters"] < rank["total_parameters"] // 2 else "full"
        host = entry.get("host_memory_per_node_gib", max(r.get("host_memory", 0) for r in entry["ranks"]) / GIB)
        group = entry["group"]
        lines.append(
            f"| {case.name} | {entry['trainer']} ({lora}) | {entry['world_size']} x 80 GB | {layout} | "
            f"{group['prompt_tokens'] + group['response_tokens']:,} | {entry['peak_gib']:.1f} | {host:.1f} | "
            f"{'yes' if entry['fits'] else 'no'} ({entry.get('device_memory_gib', 80):g} GiB) | {longest_text} |"
        )
    return "\n".join(lines)


def validation_table(validation: dict) -> str:
    """The Markdown table of the validation run: predicted and measured peak of each case, and the error."""
    lines = [f"On commit {validation.get('commit', '?')} (`{validation['command']}`: {validation['pytest_summary']}):",
             "", "| case | predicted (MiB) | measured (MiB) | error |", "|---|---:|---:|---:|"]  # fmt: skip
    for case in validation["cases"]:
        lines.append(f"| {case['case']} | {case['predicted_bytes'] / 2**20:.2f} | {case['measured_bytes'] / 2**20:.2f} | "
                     f"{case['rel_error']:+.2%} |")  # fmt: skip
    return "\n".join(lines)


DOCS = ROOT / "docs" / "memory_plan.md"
MARKERS = ("<!-- memory-plan-table -->", "<!-- /memory-plan-table -->")
VALIDATION_MARKERS = ("<!-- memory-plan-validation -->", "<!-- /memory-plan-validation -->")


def _between(text: str, markers: tuple[str, str], block: str) -> str:
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    return text[:start] + block + text[end:]


def write_docs(data: dict, path: Path = DOCS) -> None:
    """The table and summary of `data`, and its validation, between the markers of docs/memory_plan.md (generated,
    never typed)."""
    text = path.read_text()
    summary = ", ".join(f"`{k}`: {v}" for k, v in data.get("summary", {}).items())
    commits = sorted({case.get("commit", "?") for case in data["cases"].values()})
    block = (f"\nPlanned on commit(s) {', '.join(commits)} ({data.get('date', '?')}); summary: {summary}.\n\n"
             f"{table(data['cases'])}\n")  # fmt: skip
    text = _between(text, MARKERS, block)
    if data.get("validation"):
        text = _between(text, VALIDATION_MARKERS, f"\n{validation_table(data['validation'])}\n")
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/memory_plan.json")
    parser.add_argument("--longest", action="store_true", help="also search each case's longest prompt that fits")
    parser.add_argument("--only", nargs="*", help="(re)plan these cases only (default: the ones missing)")
    parser.add_argument("--validate", action="store_true",
                        help="run the CPU validation tests (plan vs measured peak) and record their errors")  # fmt: skip
    parser.add_argument("--table", type=Path, help="print the table of this results file and exit")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/memory_plan.md")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process (`run_one`'s child)
    args = parser.parse_args()
    if args.case:
        case = next(c for c in CASES if c.name == args.case)
        print("@@" + json.dumps(plan_case(case, args.longest)), flush=True)
        return
    if args.table:
        data = json.loads(args.table.read_text())
        print(table(data["cases"]))
        if args.docs:
            write_docs(data)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    data = json.loads(args.out.read_text()) if args.out.exists() else {"cases": {}}
    results = data["cases"]
    for case in CASES:
        cached = results.get(case.name)
        wanted = args.only is None and (cached is None or (args.longest and case.longest and "longest_group" not in cached))
        if not (wanted or (args.only and case.name in args.only)):
            continue
        logging.info("planning %s ...", case.name)
        results[case.name] = run_one(case, args.longest)
        entry = results[case.name]
        logging.info("  %s: peak %.2f GiB, longest %s, %.0f s", case.name, entry["peak_gib"], longest_prompt(entry), entry["seconds"])
        data["summary"] = summarize(results, data.get("validation"))
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    if args.validate:
        logging.info("validating the plan against measured CPU peaks (tests/test_memory_plan.py) ...")
        data["validation"] = validate()
    data["summary"] = summarize(results, data.get("validation"))
    data["commit"] = _commit()
    data["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    if args.docs:
        write_docs(data)
    print(table(results))
    print(json.dumps(data["summary"]))


if __name__ == "__main__":
    main()
