"""Shared-prefix layout against the unshared one, both ours, in one run: groups per second and peak memory.

For each trainer (GRM, DisRM), each number of rejected responses k and each prompt length, `SimPOGRMTrainer` /
`SimPODisRMTrainer` train the same groups with `shared_prefix=True` (the prompt once per group) and
`shared_prefix=False` (the prompt once per response), each in a fresh process forked from a fork server that has
imported the libraries once, alternating which goes first. One group (prompt + 1 chosen + k rejected responses of
64-256 tokens) per optimizer step; the first step is a short warm-up (64-token prompt), not timed. Peak memory is the
growth of the peak RSS over its value after the model was built (gradients, optimizer state, activations), as in
`train_one.py`, with glibc's mmap threshold fixed at 1 MiB so that freed activations leave the RSS (see
`common.fix_mmap_threshold`); `activation` is that growth minus the floor after the warm-up step.

Every parameter is trained (`parameters: full`), and, at the longest prompt length, a LoRA adapter as in the LoRA
recipes (`parameters: lora r=16`). The bench model is a 2-layer, 256-wide Qwen3 with Qwen's 151,936-token vocabulary:
with every parameter trained, the AdamW state and gradients of its two vocabulary matrices (~0.9 GiB for the GRM,
~0.45 GiB for the DisRM, the same in both layouts) are most of the shared run's peak; with LoRA, the peak is the
row's activations (and the GRM's log-prob chunk), which is what the layout changes.

Writes `shared_prefix.json`: `{"records": [...], "summary": {...}}`; the summary's headline keys are read at k = 4
(and k = 1) at the longest prompt length, as the smaller ratio of the two trainers (groups/s) and the larger one
(memory), so that a headline holds for both; keys ending in `_lora` are the LoRA arm's.

    python bench/shared_prefix.py --prompt-lengths 4096 16384 --ks 1 4 --out bench/results/shared_prefix.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import psutil


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402


PRELOAD = ["torch", "transformers", "datasets", "trl", "trl.experimental.cpo", "trl_longrm.trainers", "common"]


def groups_of(num_groups: int, prompt_length: int, k: int, response_range: tuple[int, int], eos: int, seed: int,
              warmup_prompt_length: int) -> list[dict]:
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(3, common.VOCAB_SIZE) for _ in range(n)]

    def response():
        return ids(rng.randint(*response_range) - 1) + [eos]

    lengths = [warmup_prompt_length] + [prompt_length] * (num_groups - 1)
    return [
        {"prompt_ids": ids(n), "chosen_completion_ids": response(), "rejected_completion_ids": [response() for _ in range(k)]}
        for n in lengths
    ]


def lora_config(trainer: str, rank: int):
    """The adapter of the LoRA recipes (`recipes/simpo_*_lora.yaml`): every linear layer, alpha = 2 r, no dropout;
    the DisRM score head is trained whole (PEFT's sequence-classification task)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM" if trainer == "grm" else "SEQ_CLS")


def run_one(trainer: str, shared: bool, prompt_length: int, k: int, steps: int, response_range: tuple[int, int],
            threads: int | None = None, seed: int = 0, lora_r: int = 0, mmap_threshold_mib: float = 1.0) -> dict:
    """Train one configuration in this process and return its record."""
    import torch

    if mmap_threshold_mib:
        common.fix_mmap_threshold(int(mmap_threshold_mib * 2**20))

    from trl_longrm.testing_utils import build_chat_tokenizer

    if threads:
        torch.set_num_threads(threads)
    tokenizer = build_chat_tokenizer()
    groups = groups_of(steps, prompt_length, k, response_range, tokenizer.eos_token_id, seed, 64)
    model = common.build_model("causal-lm" if trainer == "grm" else "seq-cls", tokenizer, seed=seed)
    base = common.maxrss_bytes()
    timer = common.StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        instance = common.build_trainer(trainer, "ours", model, tokenizer, groups, output_dir, steps, [timer],
                                        peft_config=lora_config(trainer, lora_r) if lora_r else None,
                                        shared_prefix=shared)
        instance.train()
        placed = [len(g["prompt_ids"]) * (1 if shared else k + 1)
                  + sum(len(r) for r in [g["chosen_completion_ids"], *g["rejected_completion_ids"]]) for g in groups]
    timed = timer.times[1:]
    peak = common.maxrss_bytes() - base
    floor = timer.maxrss[0] - base
    return {
        "trainer": trainer,
        "shared_prefix": shared,
        "prompt_length": prompt_length,
        "k": k,
        "status": "ok",
        "row_tokens": placed[1:],
        "step_seconds": [round(t, 3) for t in timer.times],
        "groups_per_s": len(timed) / sum(timed),
        "cpu_per_wall": sum(timer.cpu_times[1:]) / sum(timed),
        "peak_mem_bytes": peak,
        "floor_mem_bytes": floor,
        "activation_mem_bytes": peak - floor,
        "torch_threads": torch.get_num_threads(),
    }


def child_entry(config: dict, result_path: str) -> None:
    try:
        record = run_one(**config)
    except Exception:  # noqa: BLE001 - the parent records the failure and goes on
        record = {"status": "error", "error_tail": traceback.format_exc().strip().splitlines()[-5:]}
    Path(result_path).write_text(json.dumps(record))


def run_config(config: dict, mem_cap_gib: float, timeout: float) -> dict:
    """`config` in a fresh forked process under a memory and time watchdog."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD + ["shared_prefix"])
    record = {k: config[k] for k in ("trainer", "prompt_length", "k")}
    record["shared_prefix"] = config["shared"]
    record["parameters"] = f"lora r={config['lora_r']}" if config.get("lora_r") else "full"
    started, status, peak_rss = time.monotonic(), None, 0
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp, "result.json")
        process = context.Process(target=child_entry, args=(config, str(result_path)))
        process.start()
        watched = psutil.Process(process.pid)
        while process.is_alive():
            try:
                peak_rss = max(peak_rss, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            if peak_rss > mem_cap_gib * 2**30:
                status = "over_memory_cap"
            elif time.monotonic() - started > timeout:
                status = "timeout"
            if status:
                process.kill()
                break
            time.sleep(0.2)
        process.join()
        result = json.loads(result_path.read_text()) if result_path.exists() else None
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    if status is None and result is not None and result["status"] == "ok":
        return {**record, **result}
    record["status"] = status or "error"
    record["error_tail"] = (result or {}).get("error_tail", [f"exit code {process.exitcode}"])
    return record


def ratios(records: list[dict]) -> dict:
    """Shared over unshared for every (trainer, k, prompt length) both ran, and the headline keys."""
    by_key: dict[tuple, dict[bool, dict]] = {}
    for r in records:
        if r["status"] == "ok":
            key = (r.get("parameters", "full"), r["trainer"], r["k"], r["prompt_length"])
            by_key.setdefault(key, {})[r["shared_prefix"]] = r
    table = []
    for (parameters, trainer, k, length), pair in sorted(by_key.items()):
        if len(pair) == 2:
            shared, unshared = pair[True], pair[False]
            table.append({
                "parameters": parameters, "trainer": trainer, "k": k, "prompt_length": length,
                "groups_per_s_ratio": round(shared["groups_per_s"] / unshared["groups_per_s"], 3),
                # Per CPU second: what the ratio would be had both runs had the core to themselves (this machine is
                # shared; `cpu_per_wall` < 1 means other processes took part of the core during the timed steps).
                "groups_per_cpu_s_ratio": round(
                    shared["groups_per_s"] / shared["cpu_per_wall"] / (unshared["groups_per_s"] / unshared["cpu_per_wall"]),
                    3,
                ),
                "peak_mem_ratio": round(shared["peak_mem_bytes"] / unshared["peak_mem_bytes"], 3),
                "activation_mem_ratio": round(shared["activation_mem_bytes"] / max(unshared["activation_mem_bytes"], 1), 3),
            })
    summary: dict[str, object] = {"prefix_ratios": table}

    def pick(k: int, key: str, worst, lora: bool = False):
        rows = [t for t in table if t["k"] == k and (t["parameters"] != "full") == lora]
        if not rows:
            return None, None
        longest = max(t["prompt_length"] for t in rows)
        values = [t[key] for t in rows if t["prompt_length"] == longest]
        return (worst(values), longest) if len(values) == 2 else (None, longest)

    summary["prefix_k4_groups_per_s_ratio"], summary["prefix_at_prompt_length"] = pick(4, "groups_per_s_ratio", min)
    summary["prefix_k4_peak_mem_ratio"], _ = pick(4, "peak_mem_ratio", max)
    summary["prefix_k1_groups_per_s_ratio"], _ = pick(1, "groups_per_s_ratio", min)
    summary["prefix_k4_groups_per_cpu_s_ratio"], _ = pick(4, "groups_per_cpu_s_ratio", min)
    summary["prefix_k1_groups_per_cpu_s_ratio"], _ = pick(1, "groups_per_cpu_s_ratio", min)
    summary["prefix_k4_activation_mem_ratio"], _ = pick(4, "activation_mem_ratio", max)
    # The same with LoRA adapters (the LoRA recipes): no optimizer state of the full model under the peak.
    summary["prefix_k4_groups_per_s_ratio_lora"], _ = pick(4, "groups_per_s_ratio", min, lora=True)
    summary["prefix_k4_peak_mem_ratio_lora"], _ = pick(4, "peak_mem_ratio", max, lora=True)
    summary["prefix_k1_groups_per_s_ratio_lora"], _ = pick(1, "groups_per_s_ratio", min, lora=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=common.TRAINERS, default=list(common.TRAINERS))
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4], help="Numbers of rejected responses.")
    parser.add_argument("--response-range", type=int, nargs=2, default=[64, 256], help="Response lengths (tokens).")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per run; the first is not timed.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's).")
    parser.add_argument("--mmap-threshold-mib", type=float, default=1.0,
                        help="Fix glibc's mmap threshold at this size in every run, so that the peak RSS follows the "
                        "live tensors rather than heap fragmentation (see `common.fix_mmap_threshold`); 0 keeps "
                        "glibc's dynamic threshold. Default 1.")
    parser.add_argument("--lora-r", type=int, default=16,
                        help="Also train a LoRA adapter of this rank (as the LoRA recipes) instead of every parameter, "
                        "at the longest prompt length only. Default 16; 0 trains every parameter only.")
    parser.add_argument("--mem-cap-gib", type=float, default=14.0, help="Kill a run whose RSS passes this.")
    parser.add_argument("--timeout", type=float, default=900.0, help="Kill a run that takes longer (seconds).")
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the results (overwritten).")
    cli = parser.parse_args()
    if cli.steps < 2:
        parser.error("--steps must be at least 2 (one warm-up step, one timed)")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    run_info = {"command": "python " + " ".join(["bench/shared_prefix.py", *sys.argv[1:]]),
                "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "loadavg_start": round(os.getloadavg()[0], 2), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    records, flip = [], False
    longest = max(cli.prompt_lengths)
    arms = [(0, length) for length in sorted(cli.prompt_lengths)] + ([(cli.lora_r, longest)] if cli.lora_r else [])
    for trainer in cli.trainers:
        for lora_r, length in arms:
            for k in cli.ks:
                for shared in ((False, True) if flip else (True, False)):
                    config = dict(trainer=trainer, shared=shared, prompt_length=length, k=k, steps=cli.steps,
                                  response_range=tuple(cli.response_range), threads=cli.threads, lora_r=lora_r,
                                  mmap_threshold_mib=cli.mmap_threshold_mib)
                    record = run_config(config, cli.mem_cap_gib, cli.timeout)
                    records.append(record)
                    if record["status"] == "ok":
                        what = (f"{record['groups_per_s']:.4f} groups/s  peak +{record['peak_mem_bytes'] / 2**30:.2f} "
                                f"GiB (floor +{record['floor_mem_bytes'] / 2**30:.2f})  row {record['row_tokens'][0]} "
                                f"tokens  steps {record['step_seconds']} s")
                    else:
                        what = f"{record['status']}: {record.get('error_tail')}"
                    print(f"{trainer:5s} {record['parameters']:9s} k={k} prompt {length:6d} "
                          f"{'shared  ' if shared else 'unshared'} {what}", flush=True)
                    cli.out.write_text(json.dumps({"run": run_info, "records": records, "summary": ratios(records)},
                                                  indent=1))
                flip = not flip
    summary = ratios(records)
    run_info.update(finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    loadavg_end=round(os.getloadavg()[0], 2))
    cli.out.write_text(json.dumps({"run": run_info, "records": records, "summary": summary}, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "prefix_ratios"}), flush=True)


if __name__ == "__main__":
    main()
