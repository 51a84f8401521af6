"""Sequence-parallel scaling on CPU (gloo): per-rank peak memory and step time of our trainers when one packed row is
split over a ring of 1, 2 or 4 processes (`sequence_parallel_size` = world size, so every rank trains the same row).

Each ring size runs in fresh processes (`run_on_gloo_ranks`, one torch thread per rank). Per-rank peak memory is the
growth of the rank's peak RSS (`ru_maxrss`) over its value right after the model was built; the table reports the
largest over the ranks. The first (untimed) step trains a short row: the growth after it is the floor that does not
depend on the row (gradients, AdamW state, DDP gradient buckets at ring > 1), which sequence parallelism does not
split; the rest is what the row costs.

The machine has 2 cores: at ring 4 the 4 ranks share them, so step times there measure oversubscription, not scaling.

    python bench/sp_scaling.py --trainers grm --prompt-length 4096 --ring-sizes 1 2 4 --out /tmp/sp.json
    python bench/sp_scaling.py --trainers grm --prompt-length 4096 --launcher zero3 --out /tmp/sp_zero3.json
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


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

# Imported once by the fork server that forks the ranks (saves ~8 s of imports per ring size).
PRELOAD = ("transformers", "datasets", "trl", "trl.experimental.cpo", "trl_longrm.trainers", "common",
           "trl_longrm.testing_utils")


def rank_worker(rank: int, world_size: int, trainer_kind: str, prompt_length: int, response_length: int,
                warmup_prompt_length: int, steps: int, out_dir: str) -> None:
    """Entry point of each gloo rank: train `steps` steps with `sequence_parallel_size=world_size`, write a JSON."""
    from trl_longrm.sequence_parallel.launch import set_distributed_env

    set_distributed_env(rank, world_size)
    train_rank(rank, world_size, trainer_kind, prompt_length, response_length, warmup_prompt_length, steps, out_dir)


def train_rank(rank: int, world_size: int, trainer_kind: str, prompt_length: int, response_length: int,
               warmup_prompt_length: int, steps: int, out_dir: str) -> None:
    """Train `steps` steps with `sequence_parallel_size=world_size` in an initialised world, write a JSON."""
    import common

    from trl_longrm.testing_utils import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()
    groups = common.random_groups(steps, prompt_length, response_length, tokenizer.eos_token_id,
                                  warmup_prompt_length=warmup_prompt_length)
    model = common.build_model("causal-lm" if trainer_kind == "grm" else "seq-cls", tokenizer)
    base = common.maxrss_bytes()
    timer = common.StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = common.build_trainer(
            trainer_kind, "ours", model, tokenizer, groups, output_dir, steps, [timer],
            sequence_parallel_size=world_size,
        )
        trainer.train()
    result = {
        "rank": rank,
        "peak_mem_bytes": common.maxrss_bytes() - base,
        "floor_mem_bytes": timer.maxrss[0] - base,
        "step_seconds": timer.times,
        "tokens_per_step": [common.group_tokens(g) for g in groups],
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def launch_deepspeed(ring: int, trainer: str, prompt_length: int, cli, out_dir: str) -> None:
    """`accelerate launch` of `ring` ranks with DeepSpeed ZeRO (the repository's CPU configs), one thread each."""
    from trl_longrm.sequence_parallel.launch import find_free_port

    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "accelerate_configs" / f"cpu_{cli.launcher}.yaml"),
        "--num_processes", str(ring), "--main_process_port", str(find_free_port()),
        __file__, "--rank-entry", f"--trainers={trainer}", f"--prompt-length={prompt_length}",
        f"--response-length={cli.response_length}", f"--warmup-prompt-length={cli.warmup_prompt_length}",
        f"--steps={cli.steps}", f"--out={out_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=cli.timeout)
    if done.returncode:
        raise RuntimeError("\n".join(done.stderr.strip().splitlines()[-5:]))


def run_ring(ring: int, trainer: str, prompt_length: int, cli) -> dict:
    """Train on `ring` ranks; return the per-rank results summarised."""
    import sp_scaling

    from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks

    record = {"trainer": trainer, "ring_size": ring, "prompt_length": prompt_length, "launcher": cli.launcher}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            if cli.launcher == "gloo":
                run_on_gloo_ranks(
                    sp_scaling.rank_worker, ring, trainer, prompt_length, cli.response_length,
                    cli.warmup_prompt_length, cli.steps, out_dir,
                    timeout=cli.timeout, num_threads=1, preload=PRELOAD,
                )
            else:
                launch_deepspeed(ring, trainer, prompt_length, cli, out_dir)
        except (TimeoutError, subprocess.TimeoutExpired):
            record.update(status="timeout", wall_seconds=round(time.monotonic() - started, 1))
            return record
        except Exception as error:  # noqa: BLE001 - recorded in the results; the other ring sizes still run
            record.update(status="error", error=str(error).splitlines()[-5:])
            return record
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(ring)]
    timed = slice(1, None)
    step_seconds = [max(r["step_seconds"][i] for r in ranks) for i in range(cli.steps)]  # the slowest rank
    record.update(
        status="ok",
        wall_seconds=round(time.monotonic() - started, 1),
        rank_peak_mem_bytes=[r["peak_mem_bytes"] for r in ranks],
        max_rank_peak_mem_bytes=max(r["peak_mem_bytes"] for r in ranks),
        rank_floor_mem_bytes=[r["floor_mem_bytes"] for r in ranks],
        max_rank_floor_mem_bytes=max(r["floor_mem_bytes"] for r in ranks),
        step_seconds=[round(s, 3) for s in step_seconds],
        timed_step_seconds=sum(step_seconds[timed]) / len(step_seconds[timed]),
        tokens_per_step=ranks[0]["tokens_per_step"],
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=("grm", "disrm"), default=["grm"], help="Our trainers to run.")
    parser.add_argument("--prompt-length", type=int, default=8192, help="Prompt tokens; the row holds it twice.")
    parser.add_argument("--warmup-prompt-length", type=int, default=64,
                        help="Prompt of the untimed warm-up step; the memory growth after it is the row-independent "
                        "floor.")
    parser.add_argument("--response-length", type=int, default=64, help="Longest response (tokens).")
    parser.add_argument("--ring-sizes", type=int, nargs="+", default=[1, 2, 4], help="Ring (= world) sizes.")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps; the first is not timed.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds before a ring size is given up.")
    parser.add_argument("--launcher", choices=("gloo", "zero2", "zero3"), default="gloo",
                        help="gloo: plain processes (DDP over the data-parallel size, 1 here); zero2 / zero3: "
                        "`accelerate launch` with DeepSpeed ZeRO (accelerate_configs/cpu_zero*.yaml), which shards "
                        "the gradients and optimizer state (and, for zero3, the weights) over the ranks.")
    parser.add_argument("--rank-entry", action="store_true", help="Internal: one rank under `accelerate launch`.")
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the results (overwritten).")
    cli = parser.parse_args()

    if cli.rank_entry:
        import torch

        torch.set_num_threads(1)
        train_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cli.trainers[0], cli.prompt_length,
                   cli.response_length, cli.warmup_prompt_length, cli.steps, str(cli.out))
        return

    # Before the fork server starts: its workers inherit this environment (see throughput_memory.bench_env).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for trainer in cli.trainers:
        for ring in cli.ring_sizes:
            record = run_ring(ring, trainer, cli.prompt_length, cli)
            records.append(record)
            summary = ""
            if record["status"] == "ok":
                summary = (
                    f"max rank peak +{record['max_rank_peak_mem_bytes'] / 2**30:.2f} GiB "
                    f"(floor +{record['max_rank_floor_mem_bytes'] / 2**30:.2f})  steps {record['step_seconds']} s"
                )
            print(f"{trainer:5s} {cli.launcher} ring {ring}  prompt {cli.prompt_length}  {record['status']}  {summary}",
                  flush=True)
            cli.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
