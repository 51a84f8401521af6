"""GPU benchmark (needs one CUDA device; NOT run for the committed results, see bench/results/README.md): the longest
row that trains on one GPU, ours vs stock TRL, for a ~0.6B-parameter random-init model (Qwen3-0.6B's shape, bf16),
and tokens/s of all four trainers at one fixed length.

Longest row: for each (trainer, implementation) the prompt length doubles from `--start-prompt-length` until a
training run (two optimizer steps, gradient checkpointing on) raises CUDA out-of-memory, then `--bisect` halvings
narrow the gap. Each attempt runs in a fresh process (`--attempt`), so a failed allocation leaves nothing behind.
Peak memory is `torch.cuda.max_memory_allocated()` minus the allocation after the model was built.

    python bench/gpu_longest_row.py --out bench/results/gpu.json
    python bench/gpu_longest_row.py --trainers grm --impls ours --start-prompt-length 16384 --out /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402


# Qwen3-0.6B's shape (0.6B parameters with tied embeddings), random weights: nothing is downloaded.
QWEN3_0_6B = dict(
    vocab_size=common.VOCAB_SIZE,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=262144,
)


def attempt(trainer: str, impl: str, prompt_length: int, steps: int, response_length: int) -> dict:
    """One training run in this process; returns its record (status 'oom' on CUDA out-of-memory)."""
    import torch

    from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model

    tokenizer = build_chat_tokenizer()
    groups = common.random_groups(steps, prompt_length, response_length, tokenizer.eos_token_id,
                                  warmup_prompt_length=None)
    task = "causal-lm" if trainer == "grm" else "seq-cls"
    model = build_tiny_model(common.ARCH, task, tokenizer, seed=0, dtype=torch.bfloat16, **QWEN3_0_6B).cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    timer = CudaStepTimer()
    record = {"trainer": trainer, "impl": impl, "prompt_length": prompt_length}
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            instance = common.build_trainer(trainer, impl, model, tokenizer, groups, output_dir, steps, [timer],
                                            use_cpu=False, bf16=True)
            instance.train()
    except torch.OutOfMemoryError:
        record.update(status="oom", peak_mem_bytes=torch.cuda.max_memory_allocated() - base)
        return record
    tokens = [common.group_tokens(g) for g in groups]
    record.update(
        status="ok",
        tokens_per_step=tokens,
        step_seconds=timer.times,
        tokens_per_s=sum(tokens[1:]) / sum(timer.times[1:]) if steps > 1 else None,
        peak_mem_bytes=torch.cuda.max_memory_allocated() - base,
        num_params=sum(p.numel() for p in model.parameters()),
    )
    return record


class CudaStepTimer(common.StepTimer):
    """Step times with the GPU work of the step finished (CUDA runs asynchronously)."""

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        torch.cuda.synchronize()
        super().on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        import torch

        torch.cuda.synchronize()
        super().on_step_end(args, state, control, **kwargs)


def run_attempt(trainer: str, impl: str, prompt_length: int, steps: int, cli) -> dict:
    command = [sys.executable, __file__, "--attempt", f"--trainers={trainer}", f"--impls={impl}",
               f"--start-prompt-length={prompt_length}", f"--steps={steps}",
               f"--response-length={cli.response_length}", "--out=-"]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=cli.timeout)
    except subprocess.TimeoutExpired:
        return {"trainer": trainer, "impl": impl, "prompt_length": prompt_length, "status": "timeout"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"trainer": trainer, "impl": impl, "prompt_length": prompt_length, "status": "error",
                "error_tail": done.stderr.strip().splitlines()[-5:]}
    record = json.loads(lines[-1][len("RESULT ") :])
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    print(f"{trainer:5s} {impl:5s} prompt {prompt_length:7d}: {record['status']}"
          + (f", peak {record['peak_mem_bytes'] / 2**30:.1f} GiB" if "peak_mem_bytes" in record else ""), flush=True)
    return record


def longest_row(trainer: str, impl: str, cli) -> dict:
    """Doubling search, then `cli.bisect` bisection steps between the last success and the first failure."""
    attempts, good, bad = [], None, None
    length = cli.start_prompt_length
    while length <= cli.max_prompt_length:
        record = run_attempt(trainer, impl, length, 2, cli)
        attempts.append(record)
        if record["status"] != "ok":
            bad = length
            break
        good, length = length, length * 2
    for _ in range(cli.bisect if good and bad else 0):
        middle = (good + bad) // 2
        record = run_attempt(trainer, impl, middle, 2, cli)
        attempts.append(record)
        good, bad = (middle, bad) if record["status"] == "ok" else (good, middle)
    best = next((a for a in attempts if a["status"] == "ok" and a["prompt_length"] == good), None)
    return {
        "trainer": trainer,
        "impl": impl,
        "longest_prompt_length": good,
        "longest_row_tokens": max(best["tokens_per_step"]) if best else None,
        "first_failing_prompt_length": bad,
        "attempts": attempts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=common.TRAINERS, default=list(common.TRAINERS))
    parser.add_argument("--impls", nargs="+", choices=common.IMPLS, default=list(common.IMPLS))
    parser.add_argument("--start-prompt-length", type=int, default=4096, help="First prompt length tried.")
    parser.add_argument("--max-prompt-length", type=int, default=262144, help="Stop doubling past this.")
    parser.add_argument("--bisect", type=int, default=2, help="Bisection steps after the doubling search.")
    parser.add_argument("--throughput-prompt-length", type=int, default=8192,
                        help="Prompt length of the tokens/s comparison (0 to skip).")
    parser.add_argument("--steps", type=int, default=4, help="Steps of the tokens/s runs (the first is not timed).")
    parser.add_argument("--response-length", type=int, default=256, help="Longest response (tokens).")
    parser.add_argument("--timeout", type=float, default=1800.0, help="Seconds before an attempt is given up.")
    parser.add_argument("--attempt", action="store_true", help="Internal: run one attempt and print its record.")
    parser.add_argument("--out", required=True, help="JSON file of the results ('-' with --attempt).")
    cli = parser.parse_args()

    if cli.attempt:
        record = attempt(cli.trainers[0], cli.impls[0], cli.start_prompt_length, cli.steps, cli.response_length)
        print("RESULT " + json.dumps(record), flush=True)
        return

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_longest_row.py needs a CUDA device; none is visible.")
    report = {
        "versions": common.software_versions(),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "model": f"qwen3 random init, bf16, {QWEN3_0_6B}",
        "longest_row": [],
        "throughput": [],
    }
    print(json.dumps({k: report[k] for k in ("versions", "gpu", "gpu_memory_gib")}), flush=True)
    for trainer in cli.trainers:
        for impl in cli.impls:
            report["longest_row"].append(longest_row(trainer, impl, cli))
            Path(cli.out).write_text(json.dumps(report, indent=1))
    if cli.throughput_prompt_length:
        for trainer in cli.trainers:
            for impl in cli.impls:
                report["throughput"].append(run_attempt(trainer, impl, cli.throughput_prompt_length, cli.steps, cli))
                Path(cli.out).write_text(json.dumps(report, indent=1))
    for row in report["longest_row"]:
        print(f"longest row {row['trainer']:5s} {row['impl']:5s}: prompt {row['longest_prompt_length']} "
              f"({row['longest_row_tokens']} tokens per row); first failure at {row['first_failing_prompt_length']}")
    for row in report["throughput"]:
        if row.get("tokens_per_s"):
            print(f"tokens/s {row['trainer']:5s} {row['impl']:5s} at prompt {row['prompt_length']}: "
                  f"{row['tokens_per_s']:.0f}")


if __name__ == "__main__":
    main()
