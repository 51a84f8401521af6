"""Sequence-parallel scaling on CPU: per-rank peak memory and step time of our trainers when one packed row is split
over a ring of 1, 2 or 4 processes (`sequence_parallel_size` = world size, so every rank trains the same row).

Each ring size runs in fresh processes, one torch thread per rank: gloo processes (`run_on_gloo_ranks`; accelerate
then wraps the model in DDP, also at ring 1) or, with `--launcher zero2/zero3`, `accelerate launch` with DeepSpeed
ZeRO, which shards the gradients and optimizer state (zero3: and the weights) over the ranks.

Memory. Per-rank peak memory is the growth of the rank's peak RSS (`ru_maxrss`) over its value right after the model
was built; the tables report the largest over the ranks. The first `--warmup-steps` (2) steps train a short row and
are not timed: the growth after them is the floor that does not depend on the row (weights, gradients, AdamW state,
DDP buckets / DeepSpeed partitions and buffers, and the transients of a step with the optimizer state allocated:
the second step is needed for those, e.g. the 148 MiB weight gradient of the LM head before DDP copies it into its
bucket); peak - floor is what the row costs. The runs set `MALLOC_MMAP_THRESHOLD_=65536` (unless it is set already;
`--glibc-default-malloc` leaves glibc as it is): with glibc's default, dynamic mmap threshold, freed activations stay
in the heap and RSS exceeded the live tensors by up to 0.3 GiB per rank, a ring-independent amount that hid the
split (see bench/results/README.md); with a fixed threshold the RSS growth matches the live tensor bytes that
`--profile-memory` counts (bench/tensor_memory.py: the CPU analogue of `torch.cuda.max_memory_allocated`).

The machine has 2 cores: at ring 4 the 4 ranks share them, so step times there measure oversubscription, not scaling.

    python bench/sp_scaling.py --trainers grm --prompt-length 4096 --ring-sizes 1 2 4 --out /tmp/sp.json
    python bench/sp_scaling.py --trainers grm --prompt-length 4096 --launcher zero3 --ds-bucket-elements 16777216 \
        --out /tmp/sp_zero3.json
    python bench/sp_scaling.py --trainers grm --prompt-length 4096 --ring-sizes 4 --profile-memory --out /tmp/p.json
    python bench/sp_scaling.py --trainers grm --prompt-length 4096 --ring-sizes 2 4 --modes ring ulysses hybrid \
        --count-bytes --out /tmp/sp_modes.json

Modes (`--modes`, issue 32): 'ring' (each rank gathers every rank's keys/values), 'ulysses' (all-to-all over heads)
and 'hybrid' (Ulysses pairs x a ring; group sizes of 4 and up). `--count-bytes` also runs one attention layer (forward
and backward, Llama-3-8B's heads: 32 query / 8 key-value heads of 128, bf16) on gloo ranks of each mode and size, and
counts the bytes each rank receives from the collectives the attention actually issues (all-gathers, reduce-scatters,
all-to-alls, wrapped where the attention calls them); `predicted_attention_bytes` gives the same count in closed form,
checked equal to the measurement at the measured sizes and then evaluated at 128K tokens and P = 8, 16.
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
           "trl_longrm.testing_utils", "tensor_memory")


def rank_worker(rank: int, world_size: int, opts: dict, out_dir: str) -> None:
    """Entry point of each gloo rank: train with `sequence_parallel_size=world_size`, write a JSON."""
    from trl_longrm.sequence_parallel.launch import set_distributed_env

    set_distributed_env(rank, world_size)
    train_rank(rank, world_size, opts, out_dir)


def train_rank(rank: int, world_size: int, opts: dict, out_dir: str) -> None:
    """Train `opts["steps"]` steps with `sequence_parallel_size=world_size` in an initialised world, write a JSON.

    `opts`: trainer, prompt_length, response_length, warmup_prompt_length, warmup_steps, steps, profile_memory."""
    import common

    from trl_longrm.testing_utils import build_chat_tokenizer

    steps, warmup_steps = opts["steps"], opts["warmup_steps"]
    tokenizer = build_chat_tokenizer()
    groups = common.random_groups(steps, opts["prompt_length"], opts["response_length"], tokenizer.eos_token_id,
                                  warmup_prompt_length=opts["warmup_prompt_length"], warmup_steps=warmup_steps)
    callbacks = []
    if opts["profile_memory"]:
        from tensor_memory import TensorMemoryRecorder

        recorder = TensorMemoryRecorder(callers=8)
        recorder.start()  # before the model is built: every tensor's allocation is seen
        callbacks.append(recorder)
    model = common.build_model("causal-lm" if opts["trainer"] == "grm" else "seq-cls", tokenizer)
    base = common.maxrss_bytes()
    timer = common.StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = common.build_trainer(
            opts["trainer"], "ours", model, tokenizer, groups, output_dir, steps, [timer, *callbacks],
            sequence_parallel_size=world_size, **mode_fields(opts.get("mode", "ring"), world_size),
        )
        trainer.train()
    result = {
        "rank": rank,
        "peak_mem_bytes": common.maxrss_bytes() - base,
        "floor_mem_bytes": timer.maxrss[warmup_steps - 1] - base,
        "step_seconds": timer.times,
        "tokens_per_step": [common.group_tokens(g) for g in groups],
        "tensor_steps": recorder.finish(steps) if opts["profile_memory"] else None,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def write_deepspeed_config(out_dir: str, stage: int, bucket_elements: int) -> Path:
    """An accelerate config (in `out_dir`) for ZeRO-`stage` on CPU whose DeepSpeed buffers hold `bucket_elements`
    elements instead of DeepSpeed's defaults (a 5e8-element reduce bucket: 1.9 GiB in fp32, sized for GPUs of tens of
    GB, into which all gradients of this model fit at once; 5e7-element prefetch; 1e9 live parameters)."""
    zero = {
        "stage": stage,
        "reduce_bucket_size": bucket_elements,
        "allgather_bucket_size": bucket_elements,
    }
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket_elements, stage3_max_live_parameters=bucket_elements,
                    stage3_max_reuse_distance=bucket_elements, stage3_param_persistence_threshold=10_000)
    ds_config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    ds_path = Path(out_dir, "deepspeed.json")
    ds_path.write_text(json.dumps(ds_config, indent=1))
    accelerate = "\n".join([
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: DEEPSPEED",
        "deepspeed_config:",
        f"  deepspeed_config_file: {ds_path}",
        "  deepspeed_multinode_launcher: standard",
        "  zero3_init_flag: false",
        "downcast_bf16: 'no'",
        "main_process_ip: 127.0.0.1",
        "machine_rank: 0",
        "num_machines: 1",
        "num_processes: 1",
        "rdzv_backend: static",
        "same_network: true",
        "use_cpu: false",
        "",
    ])
    path = Path(out_dir, "accelerate.yaml")
    path.write_text(accelerate)
    return path


def launch_deepspeed(ring: int, trainer: str, prompt_length: int, cli, out_dir: str, mode: str = "ring") -> None:
    """`accelerate launch` of `ring` ranks with DeepSpeed ZeRO (the repository's CPU configs, or one with
    `--ds-bucket-elements` buffers), one thread each."""
    from trl_longrm.sequence_parallel.launch import find_free_port

    config_file = ROOT / "accelerate_configs" / f"cpu_{cli.launcher}.yaml"
    if cli.ds_bucket_elements:
        config_file = write_deepspeed_config(out_dir, int(cli.launcher[-1]), cli.ds_bucket_elements)
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(config_file),
        "--num_processes", str(ring), "--main_process_port", str(find_free_port()),
        __file__, "--rank-entry", f"--rank-options={json.dumps(worker_options(trainer, prompt_length, cli, mode))}",
        f"--out={out_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=cli.timeout)
    if done.returncode:
        raise RuntimeError("\n".join(done.stderr.strip().splitlines()[-5:]))


def worker_options(trainer: str, prompt_length: int, cli, mode: str = "ring") -> dict:
    return {"trainer": trainer, "prompt_length": prompt_length, "response_length": cli.response_length,
            "warmup_prompt_length": cli.warmup_prompt_length, "warmup_steps": cli.warmup_steps, "steps": cli.steps,
            "profile_memory": cli.profile_memory, "mode": mode}


def mode_fields(mode: str, size: int) -> dict:
    """Our config fields of a sequence-parallel `mode` over `size` ranks ('hybrid': Ulysses pairs x a ring)."""
    if size == 1 or mode == "ring":
        return {}
    return {"sequence_parallel_mode": mode, **({"ulysses_size": 2} if mode == "hybrid" else {})}


def run_ring(ring: int, trainer: str, prompt_length: int, cli, mode: str = "ring") -> dict:
    """Train on `ring` ranks (a sequence-parallel group of that size, in `mode`); return the per-rank results
    summarised."""
    import sp_scaling

    from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks

    record = {"trainer": trainer, "ring_size": ring, "mode": mode, "prompt_length": prompt_length,
              "launcher": cli.launcher,
              "ds_bucket_elements": cli.ds_bucket_elements if cli.launcher != "gloo" else None,
              "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "warmup_steps": cli.warmup_steps}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            if cli.launcher == "gloo":
                run_on_gloo_ranks(
                    sp_scaling.rank_worker, ring, worker_options(trainer, prompt_length, cli, mode), out_dir,
                    timeout=cli.timeout, num_threads=1, preload=PRELOAD,
                )
            else:
                launch_deepspeed(ring, trainer, prompt_length, cli, out_dir, mode)
        except (TimeoutError, subprocess.TimeoutExpired):
            record.update(status="timeout", wall_seconds=round(time.monotonic() - started, 1))
            return record
        except Exception as error:  # noqa: BLE001 - recorded in the results; the other ring sizes still run
            record.update(status="error", error=str(error).splitlines()[-5:])
            return record
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(ring)]
    timed = slice(cli.warmup_steps, None)
    step_seconds = [max(r["step_seconds"][i] for r in ranks) for i in range(cli.steps)]  # the slowest rank
    record.update(
        status="ok",
        wall_seconds=round(time.monotonic() - started, 1),
        rank_peak_mem_bytes=[r["peak_mem_bytes"] for r in ranks],
        max_rank_peak_mem_bytes=max(r["peak_mem_bytes"] for r in ranks),
        rank_floor_mem_bytes=[r["floor_mem_bytes"] for r in ranks],
        max_rank_floor_mem_bytes=max(r["floor_mem_bytes"] for r in ranks),
        # What the row costs on each rank (peak - floor of that rank), and its largest over the ranks.
        rank_row_mem_bytes=[r["peak_mem_bytes"] - r["floor_mem_bytes"] for r in ranks],
        max_rank_row_mem_bytes=max(r["peak_mem_bytes"] - r["floor_mem_bytes"] for r in ranks),
        step_seconds=[round(s, 3) for s in step_seconds],
        timed_step_seconds=sum(step_seconds[timed]) / len(step_seconds[timed]),
        tokens_per_step=ranks[0]["tokens_per_step"],
    )
    if cli.profile_memory:
        record["rank_tensor_steps"] = [r["tensor_steps"] for r in ranks]
    return record


# One attention layer of Llama-3-8B (heads, key/value heads, head size) in bf16, for the byte counts.
LLAMA3_8B_HEADS = (32, 8, 128)
BYTES_TOKENS = 1024
"""Tokens of the measured layer (the count is linear in it: evaluated at 128K from the closed form)."""


def predicted_attention_bytes(
    mode: str,
    size: int,
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    element_bytes: int = 2,
    ulysses_size: int = 2,
) -> int:
    """Bytes one rank receives per attention layer, forward + backward, in `mode` over `size` ranks.

    Ulysses (u ranks): q, k, v and the output are all-to-all'd in the forward, their gradients in the backward; a rank
    receives (u - 1) / u of what it sends, its slice's q and output (all heads) and k, v (`kv_heads`, or `u` when the
    heads are replicated). Ring (r places): each rank all-gathers the row's keys/values (its share of the key/value
    heads) in the forward and again in the backward, and reduce-scatters their float32 gradients."""
    u = 1 if mode == "ring" or size == 1 else (size if mode == "ulysses" else ulysses_size)
    r = size // u
    received = 0
    if u > 1:
        local = tokens // size
        sent = local * head_dim * (2 * heads + 2 * max(kv_heads, u)) * element_bytes  # q, k, v, out
        received += 2 * sent * (u - 1) // u  # forward and backward
    if r > 1:
        place = tokens // r  # tokens of a place (after the Ulysses exchange)
        kv = place * max(kv_heads // u, 1) * head_dim * 2  # keys and values, elements
        received += (r - 1) * kv * (2 * element_bytes + 4)  # two gathers in the attention dtype, a float32 scatter
    return received


def bytes_worker(rank: int, world_size: int, runs: list, out_dir: str) -> None:
    """One Llama-3-8B attention layer, forward and backward, per (mode) on a group of the whole world; counts the
    bytes this rank receives from the collectives the attention issues."""
    import torch
    import torch.distributed as dist

    from trl_longrm.sequence_parallel import (
        SequenceParallelConfig,
        attention,
        collectives,
        init_sequence_parallel_groups,
        shard_packed_row,
    )
    from trl_longrm.sequence_parallel.attention import ring_attention_forward

    received = {"bytes": 0}

    def counting(start, kind):
        def wrapped(tensor, group, async_op=True):
            out, work = start(tensor, group, async_op)
            peers = dist.get_world_size(group) - 1
            share = tensor.numel() * tensor.element_size()
            received["bytes"] += peers * share if kind == "gather" else peers * share // (peers + 1)
            return out, work

        return wrapped

    attention.start_all_gather_dim0 = counting(collectives.start_all_gather_dim0, "gather")
    attention.start_reduce_scatter_dim0 = counting(collectives.start_reduce_scatter_dim0, "scatter")
    all_to_all = dist.all_to_all_single

    def counting_all_to_all(output, tensor, *args, group=None, **kwargs):
        size = dist.get_world_size(group)
        received["bytes"] += tensor.numel() * tensor.element_size() * (size - 1) // size
        return all_to_all(output, tensor, *args, group=group, **kwargs)

    dist.all_to_all_single = counting_all_to_all
    heads, kv_heads, head_dim = LLAMA3_8B_HEADS
    module = type("Attention", (), {"is_causal": True})()
    results = {}
    for mode in runs:
        fields = mode_fields(mode, world_size)
        groups = init_sequence_parallel_groups(
            world_size, fields.get("sequence_parallel_mode", "ring"), fields.get("ulysses_size")
        )
        config = SequenceParallelConfig(sequence_parallel_size=world_size, **fields)
        shard = shard_packed_row(torch.zeros(1, BYTES_TOKENS, dtype=torch.long), groups=groups, config=config)
        local = shard.attention_meta.local_length
        gen = torch.Generator().manual_seed(rank)
        q, k, v = (
            torch.randn(1, n, local, head_dim, generator=gen, dtype=torch.bfloat16).requires_grad_()
            for n in (heads, kv_heads, kv_heads)
        )
        received["bytes"] = 0
        started = time.perf_counter()
        out, _ = ring_attention_forward(
            module, q, k, v, None, scaling=head_dim**-0.5, ring_attn_meta=shard.attention_meta
        )
        out.float().sum().backward()
        results[mode] = {"received_bytes": received["bytes"], "seconds": time.perf_counter() - started}
    Path(out_dir, f"bytes{rank}.json").write_text(json.dumps(results))


def count_bytes(sizes: list[int], modes: list[str]) -> dict:
    """Measured bytes per rank per layer (the largest over the ranks) for each mode and size, the closed form at the
    same shape, and the closed form at 128K tokens for P = 8 and 16."""
    import sp_scaling

    from trl_longrm.sequence_parallel.launch import run_on_gloo_ranks

    heads, kv_heads, head_dim = LLAMA3_8B_HEADS
    measured = []
    for size in sizes:
        runs = [m for m in modes if m != "hybrid" or size >= 4]
        with tempfile.TemporaryDirectory() as out_dir:
            run_on_gloo_ranks(sp_scaling.bytes_worker, size, runs, out_dir, timeout=600, preload=PRELOAD)
            ranks = [json.loads(Path(out_dir, f"bytes{r}.json").read_text()) for r in range(size)]
        for mode in runs:
            got = max(r[mode]["received_bytes"] for r in ranks)
            want = predicted_attention_bytes(mode, size, BYTES_TOKENS, heads, kv_heads, head_dim)
            measured.append(
                {
                    "mode": mode,
                    "size": size,
                    "tokens": BYTES_TOKENS,
                    "measured_bytes": got,
                    "predicted_bytes": want,
                    "seconds": max(r[mode]["seconds"] for r in ranks),
                }
            )
            if got != want:
                raise RuntimeError(f"{mode} x{size}: measured {got} bytes per layer, the closed form says {want}.")
    at_128k = {
        f"{mode}_p{size}": predicted_attention_bytes(mode, size, 131072, heads, kv_heads, head_dim)
        for mode in modes
        for size in (8, 16)
    }
    return {
        "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": "bfloat16"},
        "measured": measured,
        "predicted_128k": at_128k,
        "ulysses_vs_ring_bytes_p8": at_128k.get("ulysses_p8", 0) / at_128k["ring_p8"] if "ring" in modes else None,
        "ulysses_vs_ring_bytes_p16": at_128k.get("ulysses_p16", 0) / at_128k["ring_p16"] if "ring" in modes else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=("grm", "disrm"), default=["grm"], help="Our trainers to run.")
    parser.add_argument("--prompt-length", type=int, default=8192, help="Prompt tokens; the row holds it twice.")
    parser.add_argument("--warmup-prompt-length", type=int, default=64,
                        help="Prompt of the untimed warm-up steps; the memory growth after them is the row-independent "
                        "floor.")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="Short untimed steps first: the first allocates the gradients and the optimizer state, the "
                        "second has the transients of a step with the optimizer state allocated.")
    parser.add_argument("--response-length", type=int, default=64, help="Longest response (tokens).")
    parser.add_argument("--ring-sizes", type=int, nargs="+", default=[1, 2, 4], help="Ring (= world) sizes.")
    parser.add_argument("--steps", type=int, default=4, help="Optimizer steps, warm-up steps included.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds before a ring size is given up.")
    parser.add_argument("--launcher", choices=("gloo", "zero2", "zero3"), default="gloo",
                        help="gloo: plain processes (DDP over the data-parallel size, 1 here); zero2 / zero3: "
                        "`accelerate launch` with DeepSpeed ZeRO (accelerate_configs/cpu_zero*.yaml), which shards "
                        "the gradients and optimizer state (and, for zero3, the weights) over the ranks.")
    parser.add_argument("--ds-bucket-elements", type=int, default=None,
                        help="With a zero2/zero3 launcher: size DeepSpeed's reduce/allgather/prefetch buckets and live-"
                        "parameter limit to this many elements (a generated DeepSpeed config) instead of DeepSpeed's "
                        "defaults (5e8-element reduce bucket, 1e9 live parameters).")
    parser.add_argument("--profile-memory", action="store_true",
                        help="Also record every rank's allocator events (torch.profiler) and print, per step, the live "
                        "tensor bytes at its start and their peak, and what was alive at the peak (bench/tensor_memory.py"
                        "). Slower.")
    parser.add_argument("--profile-rows", type=int, default=15, help="Rows of the --profile-memory breakdown.")
    parser.add_argument("--glibc-default-malloc", action="store_true",
                        help="Do not set MALLOC_MMAP_THRESHOLD_: RSS then also counts what glibc keeps of freed memory.")
    parser.add_argument("--modes", nargs="+", choices=("ring", "ulysses", "hybrid"), default=["ring"],
                        help="Sequence-parallel modes to train with at each size ('hybrid': Ulysses pairs x a ring, "
                        "sizes of 4 and up).")
    parser.add_argument("--count-bytes", action="store_true",
                        help="Also count the bytes each rank receives per attention layer in each mode (see above).")
    parser.add_argument("--rank-entry", action="store_true", help="Internal: one rank under `accelerate launch`.")
    parser.add_argument("--rank-options", default=None, help="Internal: the rank's options (JSON).")
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the results (overwritten).")
    cli = parser.parse_args()

    if cli.rank_entry:
        import torch

        torch.set_num_threads(1)
        train_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), json.loads(cli.rank_options), str(cli.out))
        return
    if cli.warmup_steps < 1 or cli.steps <= cli.warmup_steps:
        parser.error("need 1 <= --warmup-steps < --steps")

    # Before the fork server (or accelerate) starts: the ranks inherit this environment, and glibc reads its
    # MALLOC_* variables when a process starts.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not cli.glibc_default_malloc:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    if cli.count_bytes:
        counts = count_bytes([s for s in cli.ring_sizes if s > 1], cli.modes)
        records.append({"bytes_per_layer": counts})
        for row in counts["measured"]:
            print(f"bytes {row['mode']:8s} x{row['size']}  {row['measured_bytes'] / 2**20:.2f} MiB per rank per layer "
                  f"({row['tokens']} tokens; closed form {row['predicted_bytes'] / 2**20:.2f})", flush=True)
        print("at 128K tokens (GB): " + "  ".join(f"{k} {v / 1e9:.2f}" for k, v in counts["predicted_128k"].items()),
              flush=True)
        cli.out.write_text(json.dumps(records, indent=1))
    runs = [(trainer, ring, mode) for trainer in cli.trainers for ring in cli.ring_sizes for mode in cli.modes
            if not (ring == 1 and mode != "ring") and not (mode == "hybrid" and ring < 4)]  # fmt: skip
    for trainer, ring, mode in runs:
        record = run_ring(ring, trainer, cli.prompt_length, cli, mode)
        records.append(record)
        summary = ""
        if record["status"] == "ok":
            summary = (
                f"max rank peak +{record['max_rank_peak_mem_bytes'] / 2**30:.2f} GiB "
                f"(floor +{record['max_rank_floor_mem_bytes'] / 2**30:.2f}, row "
                f"+{record['max_rank_row_mem_bytes'] / 2**30:.2f})  steps {record['step_seconds']} s"
            )
        print(f"{trainer:5s} {cli.launcher} {mode} {ring}  prompt {cli.prompt_length}  {record['status']}  {summary}",
              flush=True)
        if cli.profile_memory and record["status"] == "ok":
            from tensor_memory import print_report

            for rank, report in enumerate(record["rank_tensor_steps"]):
                print_report(f"  {mode} {ring} rank {rank}", report, rows=cli.profile_rows)
        cli.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
