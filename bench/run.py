"""Run the whole CPU benchmark (what `make bench` and `make bench-quick` call) and end with one JSON line of ratios.

1. `throughput_memory.py`: tokens/s and peak memory, ours vs stock TRL, for both trainers and several prompt lengths.
2. `sp_scaling.py`: per-rank peak memory and step time of the GRM trainer at ring sizes 1, 2, 4 with gloo processes
   (DDP, `sp_scaling.json`), then at ring sizes 1 and 4 under DeepSpeed ZeRO-3 on a 4x longer row
   (`sp_scaling_zero3.json`: the headline `sp4_vs_sp1_rank_mem_ratio`, see bench/results/README.md); then the
   sequence-parallel modes (ring, Ulysses, hybrid) at group sizes 2 and 4 and the bytes each rank receives per
   attention layer (`sp_modes.json`: `ulysses_vs_ring_bytes_p8`, `ulysses4_vs_ring4_step_time`).
3. `shared_prefix.py`: ours with `shared_prefix=True` vs ours with it off, GRM and DisRM, k = 1 and 4, groups/s and
   peak memory (`shared_prefix.json`).
4. `reward_function.py`: `LongRMReward` vs TRL's reward-model path, 8 completions of one long prompt, seconds per
   call and peak memory (`reward_function.json`).
5. `report.py`: `results.md`, `bench.png`, `summary.json` in the output directory, and the JSON line.

The GPU section (`gpu_longest_row.py`) is not part of it: it needs a CUDA device.

    python bench/run.py --preset full --out bench/results          # about 21 minutes on a 2-core CPU
    python bench/run.py --preset quick --out bench/results/quick   # under 3 minutes
    python bench/run.py --preset full --out bench/results --skip-throughput   # the SP sections only (~8 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PRESETS = {
    # Prompt lengths double up to where stock CPO's [tokens, 151936] logits pass the memory cap; 3 steps = one short
    # warm-up step and two timed steps of the full length.
    # DisRM goes one doubling further: stock RewardTrainer has no vocabulary logits, its extra cost is the 4-D
    # attention mask, quadratic in the row, which dominates only from ~16K-token prompts at this model size.
    # SP: 2 short warm-up steps (the floor) then full-length steps; the ZeRO-3 run uses a 4x longer row (the longest
    # whose ring-4 run stays under ~5 minutes here) and DeepSpeed buffers of 2**24 elements (see sp_scaling.py).
    "full": dict(grm_lengths=[1024, 2048, 4096, 8192], disrm_lengths=[1024, 2048, 4096, 8192, 16384], steps=3,
                 sp_prompt_length=4096, sp_rings=[1, 2, 4], sp_steps=4,
                 sp_zero3_prompt_length=16384, sp_zero3_rings=[1, 4], sp_zero3_bucket_elements=2**24,
                 prefix_lengths=[4096, 16384], prefix_ks=[1, 4], prefix_responses=[64, 256],
                 reward_prompt_tokens=16384),
    "quick": dict(grm_lengths=[256, 512], disrm_lengths=[256, 512], steps=2, sp_prompt_length=256,
                  sp_rings=[1, 2, 4], sp_steps=3,
                  sp_zero3_prompt_length=None, sp_zero3_rings=[1, 4], sp_zero3_bucket_elements=2**24,
                  prefix_lengths=[256, 512], prefix_ks=[1, 4], prefix_responses=[16, 64],
                  reward_prompt_tokens=1024),
}


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run(command: list[str]) -> None:
    """Run a step of the benchmark, its output going to ours; the library's import-time warnings are dropped."""
    print("+ " + shlex.join(command), flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if not any(noise in line for noise in ("Warning", "warnings.warn", "[WARNING]", "kernels-community")):
            print(line, end="", flush=True)
    if process.wait():
        raise SystemExit(f"{command[1]} failed with exit status {process.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full", help="Sizes: full or quick.")
    parser.add_argument("--out", type=Path, required=True, help="Directory for the results (files overwritten).")
    parser.add_argument("--mem-cap-gib", type=float, default=14.0, help="Kill a single-process run past this RSS.")
    parser.add_argument("--skip-sp", action="store_true", help="Leave out the sequence-parallel sections.")
    parser.add_argument("--skip-prefix", action="store_true", help="Leave out the shared-prefix section.")
    parser.add_argument("--skip-reward", action="store_true", help="Leave out the reward-function section.")
    parser.add_argument("--skip-throughput", action="store_true",
                        help="Re-run only the sequence-parallel sections: keep throughput_memory.jsonl and its run's "
                        "meta.json entries, and rebuild the report.")
    cli = parser.parse_args()
    if cli.skip_sp and cli.skip_throughput:
        parser.error("--skip-sp and --skip-throughput leave nothing to run")
    preset = PRESETS[cli.preset]
    cli.out.mkdir(parents=True, exist_ok=True)

    import common

    started = time.monotonic()
    meta_path = cli.out / "meta.json"
    previous = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta = {
        "command": "python " + shlex.join(["bench/run.py", *sys.argv[1:]]),
        "preset": cli.preset,
        "started": now(),
        "loadavg_start": round(os.getloadavg()[0], 2),
        "cpus_allowed": len(os.sched_getaffinity(0)),  # fewer than the machine's cores under `taskset`
        "machine": common.machine_description(),
        "versions": common.software_versions(),
        "model": (
            f"{common.ARCH}, {common.MODEL_OVERRIDES['num_hidden_layers']} layers, hidden "
            f"{common.MODEL_OVERRIDES['hidden_size']}, vocab {common.VOCAB_SIZE}, fp32, random init"
        ),
        "data": (
            "one preference group per step (prompt shared by chosen and 1 rejected response of 32-64 tokens), random "
            f"token ids; {preset['steps']} optimizer steps per run, the first a short warm-up (64-token prompt), "
            "not timed; gradient checkpointing on, AdamW (each config's TRL default)."
        ),
    }
    if cli.skip_throughput:
        # The throughput section's meta stays that of the run that produced it; this run is recorded under "sp_run".
        sp_meta = {k: meta[k] for k in ("command", "started", "loadavg_start", "machine", "versions", "cpus_allowed")}
        meta = {**previous, "sp_run": sp_meta}
    else:
        meta["data"] += (" SP runs: 2 short warm-up steps, then full-length steps." if not cli.skip_sp else "")
    meta_path.write_text(json.dumps(meta, indent=1))
    python = sys.executable
    if not cli.skip_throughput:
        run([python, str(HERE / "throughput_memory.py"), "--lengths", *map(str, preset["grm_lengths"]),
             "--grm-lengths", *map(str, preset["grm_lengths"]), "--disrm-lengths", *map(str, preset["disrm_lengths"]),
             "--steps", str(preset["steps"]), "--mem-cap-gib", str(cli.mem_cap_gib),
             "--out", str(cli.out / "throughput_memory.jsonl")])
    sp_path, zero3_path = cli.out / "sp_scaling.json", cli.out / "sp_scaling_zero3.json"
    if cli.skip_sp:
        sp_path.unlink(missing_ok=True)
        zero3_path.unlink(missing_ok=True)
    else:
        # GRM only; `sp_scaling.py --trainers disrm` runs the other one.
        run([python, str(HERE / "sp_scaling.py"), "--trainers", "grm",
             "--prompt-length", str(preset["sp_prompt_length"]), "--ring-sizes", *map(str, preset["sp_rings"]),
             "--steps", str(preset["sp_steps"]), "--out", str(sp_path)])
        zero3_path.unlink(missing_ok=True)
        if preset["sp_zero3_prompt_length"]:
            run([python, str(HERE / "sp_scaling.py"), "--trainers", "grm", "--launcher", "zero3",
                 "--ds-bucket-elements", str(preset["sp_zero3_bucket_elements"]),
                 "--prompt-length", str(preset["sp_zero3_prompt_length"]),
                 "--ring-sizes", *map(str, preset["sp_zero3_rings"]), "--steps", str(preset["sp_steps"]),
                 "--timeout", "590", "--out", str(zero3_path)])
    modes_path = cli.out / "sp_modes.json"
    if cli.skip_sp:
        modes_path.unlink(missing_ok=True)
    else:
        # Ring, Ulysses and hybrid at group sizes 2 and 4, and the bytes their attention receives per layer.
        run([python, str(HERE / "sp_scaling.py"), "--trainers", "grm", "--modes", "ring", "ulysses", "hybrid",
             "--count-bytes", "--prompt-length", str(preset["sp_prompt_length"]), "--ring-sizes", "2", "4",
             "--steps", str(preset["sp_steps"]), "--out", str(modes_path)])
    prefix_path = cli.out / "shared_prefix.json"
    if cli.skip_prefix:
        prefix_path.unlink(missing_ok=True)
    elif not cli.skip_throughput:
        run([python, str(HERE / "shared_prefix.py"), "--prompt-lengths", *map(str, preset["prefix_lengths"]),
             "--ks", *map(str, preset["prefix_ks"]), "--response-range", *map(str, preset["prefix_responses"]),
             "--mem-cap-gib", str(cli.mem_cap_gib), "--out", str(prefix_path)])
    reward_path = cli.out / "reward_function.json"
    if cli.skip_reward:
        reward_path.unlink(missing_ok=True)
    elif not cli.skip_throughput:
        run([python, str(HERE / "reward_function.py"), "--prompt-tokens", str(preset["reward_prompt_tokens"]),
             "--output", str(reward_path)])
    finished = dict(finished=now(), wall_minutes=round((time.monotonic() - started) / 60, 1),
                    loadavg_end=round(os.getloadavg()[0], 2))
    (meta["sp_run"] if cli.skip_throughput else meta).update(finished)
    meta_path.write_text(json.dumps(meta, indent=1))
    run([python, str(HERE / "report.py"), "--results", str(cli.out)])


if __name__ == "__main__":
    main()
