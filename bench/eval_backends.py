"""Records per second of `trl-longrm eval`'s three backends side by side, on CPU, on the same records: the demo's
trained judge (stage I, pointwise, PairWise records) and DisRM (PairWise and BestOfN) with heads of 64 dimensions (which
vLLM's CPU attention runs), on the demo benchmark, through transformers in this process, an in-process `vllm.LLM`
(run from vLLM's venv, `make vllm`) and a vLLM server queried over HTTP (`--backend openai`), one engine at a time.

Engine start-up (loading the model, vLLM's KV cache and warm-up; the server's start until `/health` answers) is timed
apart from judging. Each backend's judgments are also compared with transformers': identical judgments and the largest
score difference. On a GPU the speed is the engine's (vLLM's continuous batching and prefix caching); these CPU figures
only show the three paths side by side on one machine.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/eval_backends.py --out bench/results/eval_backends.json

`--demo-dir` keeps the trained demo between runs (the demo resumes its folder); default a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("TRL_LONGRM_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
# vLLM on CPU: float32 (the transformers reference's dtype), a KV cache of 8% of RAM, a 4096-token context (longer
# than every demo record: nothing is cut, so all backends judge the same tokens).
MAX_LENGTH = 4096
KV_SHARE = 0.08
SERVER_ARGS = ["--dtype", "float32", "--gpu-memory-utilization", str(KV_SHARE), "--max-model-len", str(MAX_LENGTH)]
SERVER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def eval_settings(kind: str, demo_dir: Path) -> dict:
    """The `EvalConfig` fields of a model of the demo (the demo's own evaluation settings, at MAX_LENGTH)."""
    from trl_longrm.demo import DEMO_JUDGE_PROTOCOL, JUDGE_PROMPTS

    common = dict(data_path=str(demo_dir / "data" / "bench"), max_length=MAX_LENGTH, batch_size=16, seed=0)
    if kind == "disrm":
        return dict(common, model_path=str(demo_dir / "runs" / "simpo_disrm"), is_disrm=True)
    return dict(common, model_path=str(demo_dir / "runs" / "sft"), formats=["PairWise"], max_new_tokens=16,
                judge_protocol=DEMO_JUDGE_PROTOCOL, prompt_template=str(JUDGE_PROMPTS))  # fmt: skip


def timed_eval(settings: dict, started: float) -> dict:
    """Build the judge of `settings` (timed from `started`: an engine's start), then judge every record (timed)."""
    from trl_longrm.evaluation import EvalConfig, evaluate_reward_model
    from trl_longrm.evaluation.runner import build_judge
    from trl_longrm.evaluation.templates import PromptTemplate

    config = EvalConfig(**settings)
    template = PromptTemplate.from_yaml(config.prompt_template) if config.prompt_template else PromptTemplate.default()
    judge = build_judge(config, template, config.device)
    built = time.perf_counter()
    results = evaluate_reward_model(config, judge=judge)
    done = time.perf_counter()
    records = results["counts"]["records"]
    return {
        "start_s": round(built - started, 1),
        "judge_s": round(done - built, 2),
        "records": records,
        "records_per_s": round(records / (done - built), 2),
        "pairwise_avg": results["pairwise_avg"],
        "auc": results["auc"],
    }


def agreement(reference: Path, other: Path) -> dict:
    """How the predictions in `other` compare with transformers' in `reference`."""

    def load(path):
        return {p["id"]: p for p in map(json.loads, (path / "predictions.jsonl").read_text().splitlines())}

    want, got = load(reference), load(other)
    # A DisRM writes no judgments: only its scores compare.
    judged = any(p["judgments"] is not None for p in want.values())
    same = sum(got[key]["judgments"] == want[key]["judgments"] for key in want) if judged else None
    diffs = [abs(a - b) for key in want for a, b in zip(got[key]["scores"] or [], want[key]["scores"] or [])]
    return {"same_judgments": same, "of": len(want), "max_score_diff": max(diffs, default=None)}


def vllm_worker(kind: str, demo_dir: Path, save_path: Path) -> None:
    """In vLLM's venv: one backend-vllm run, its timings printed as the last line."""
    started = time.perf_counter()
    settings = dict(eval_settings(kind, demo_dir), save_path=str(save_path), backend="vllm", dtype="float32",
                    gpu_memory_utilization=KV_SHARE)  # fmt: skip
    print("TIMINGS " + json.dumps(timed_eval(settings, started)), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo-dir", default=None, help="Folder of the trained demo (trained there if absent).")
    parser.add_argument("--out", default=None, help="JSON file to write (default: print only).")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "DEMO_DIR", "SAVE_PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, demo_dir, save_path = args.worker
        vllm_worker(kind, Path(demo_dir), Path(save_path))
        return 0

    import torch

    from trl_longrm.demo import SMALL_DEMO, DemoConfig, run_demo
    from trl_longrm.serving.server import VLLMServer

    if not VLLM_PYTHON.exists():
        sys.exit(f"vLLM's venv is missing ({VLLM_PYTHON}): run `make vllm`.")
    work = Path(tempfile.mkdtemp(prefix="eval_backends_"))
    demo_dir = Path(args.demo_dir) if args.demo_dir else work / "demo"
    # The reduced demo of the test suite, stage I only for the judge, heads of 64 dimensions.
    run_demo(DemoConfig(output_dir=str(demo_dir), head_dim=64, stages=["simpo_disrm", "sft"], **SMALL_DEMO))

    rows = {}
    for kind in ("grm", "disrm"):
        settings = eval_settings(kind, demo_dir)
        paths = {backend: work / f"{backend}_{kind}" for backend in ("transformers", "vllm", "openai")}
        row = {}
        started = time.perf_counter()
        row["transformers"] = timed_eval(
            dict(settings, save_path=str(paths["transformers"]), device="cpu", dtype="float32"), started
        )
        run = subprocess.run([str(VLLM_PYTHON), __file__, "--worker", kind, str(demo_dir), str(paths["vllm"])],
                             capture_output=True, text=True, env={**os.environ, **SERVER_ENV, "PYTHONPATH": str(ROOT)})  # fmt: skip
        if run.returncode:
            sys.exit(f"vLLM worker failed:\n{run.stderr[-4000:]}")
        # vLLM may print after the worker's line (its shutdown).
        line = next(line for line in run.stdout.splitlines() if line.startswith("TIMINGS "))
        row["vllm"] = json.loads(line.removeprefix("TIMINGS "))
        server_args = [*SERVER_ARGS, *(["--runner", "pooling"] if kind == "disrm" else [])]
        started = time.perf_counter()
        with VLLMServer(settings["model_path"], served_model_name=kind, args=server_args, python=str(VLLM_PYTHON),
                        env=SERVER_ENV, startup_timeout=600) as server:  # fmt: skip
            row["openai"] = timed_eval(
                dict(settings, save_path=str(paths["openai"]), backend="openai", base_url=server.base_url), started
            )
        for backend in ("vllm", "openai"):
            row[backend]["vs_transformers"] = agreement(paths["transformers"], paths[backend])
        rows[kind] = row
        print(kind, json.dumps(row), flush=True)

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip())  # fmt: skip
    vllm_version = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]  # fmt: skip
    result = {
        "commit": commit + ("-dirty" if dirty else ""),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "vllm": vllm_version},  # fmt: skip
        "settings": {"max_length": MAX_LENGTH, "batch_size": 16, "dtype": "float32", "kv_cache_share": KV_SHARE,
                     "max_concurrency": 8},  # fmt: skip
        "models": {"grm": "demo judge after stage I (pointwise, 2 heads of 64)", "disrm": "demo DisRM (2 heads of 64)"},
        "results": rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
