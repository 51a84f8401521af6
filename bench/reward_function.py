"""`LongRMReward` against TRL's own reward-model path on the same DisRM: 8 completions of 256 tokens of one 16K-token
prompt (GRPO's `num_generations=8`), on CPU (a small DisRM) or with `--device cuda` on a GPU (Qwen3-0.6B's shape, bf16).

Each path runs in its own process (peak memory is per process): TRL's path is `GRPOTrainer._calculate_rewards` with
`reward_funcs="<the DisRM's path>"` (its own loading, chat template rendering, right-padded batch and pooling); ours
is `LongRMReward(path)`. Reported: seconds per call (best of `--repeats`, after a first call) and the peak resident memory
the first call adds over the process's memory before it (`ru_maxrss`; on a GPU `torch.cuda.max_memory_allocated`), and
the ratios side by side in one run. The rewards of the two paths are checked equal first (1e-4 in float32 on CPU;
0.05 in bf16 on a GPU, where the two paths' kernels round differently).

    python bench/reward_function.py                       # one JSON line; also bench/results/reward_function.json
    python bench/reward_function.py --prompt-tokens 4096  # smaller
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A DisRM big enough that the prompt's encoding dominates, small enough for 2 CPU cores.
MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# On a GPU: Qwen3-0.6B's shape (random weights), the scale of a reward model used beside GRPO on one GPU.
MODEL_CUDA = dict(arch="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _words(seed: int, n: int) -> str:
    import random

    from trl_longrm.testing_utils import _WORDS

    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _batch(tokenizer, prompt_tokens: int, completion_tokens: int, generations: int):
    """One prompt of about `prompt_tokens` tokens and `generations` completions of about `completion_tokens`."""
    def fit(seed, tokens):
        text, n = "", tokens
        while True:
            text = _words(seed, n)
            length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if abs(length - tokens) <= max(4, tokens // 100):
                return text
            n = max(1, int(n * tokens / length))

    prompt = [{"role": "user", "content": fit(0, prompt_tokens)}]
    completions = [[{"role": "assistant", "content": fit(1 + g, completion_tokens)}] for g in range(generations)]
    return [prompt] * generations, completions


def worker(path: str, which: str, cli) -> dict:
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(cli.threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts, completions = _batch(tokenizer, cli.prompt_tokens, cli.completion_tokens, cli.generations)
    if which == "stock":
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(
            model=str(Path(path).parent / "policy"), reward_funcs=path,
            args=GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=cli.device == "cpu", bf16=cli.device == "cuda",
                            report_to=[],
                            per_device_train_batch_size=cli.generations, num_generations=cli.generations),
            train_dataset=Dataset.from_list([{"prompt": prompts[0]}]),
        )  # fmt: skip
        inputs = [{"prompt": p} for p in prompts]

        def call():
            return trainer._calculate_rewards(inputs, prompts, completions, [[0]] * len(prompts))[:, 0].tolist()
    else:
        from trl_longrm import LongRMReward

        reward = LongRMReward(path, device=cli.device)

        def call():
            return reward(prompts=prompts, completions=completions)

    # Memory: the first call's peak over the resident memory before it (large CPU tensors are mapped and unmapped,
    # so what a call frees leaves the resident set). Time: the best of the calls after it.
    cuda = cli.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() // 1024
    else:
        before = _rss_kib()
    warm = call()
    peak = torch.cuda.max_memory_allocated() // 1024 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(cli.repeats):
        start = time.perf_counter()
        rewards = call()  # a list of floats: the device's work is done
        times.append(time.perf_counter() - start)
    sequence_tokens = [len(ids) for ids in tokenizer([tokenizer.apply_chat_template(p + c, tokenize=False)
                                                       for p, c in zip(prompts, completions)])["input_ids"]]  # fmt: skip
    return {"seconds": min(times), "peak_added_mib": max(peak - before, 0) / 1024, "rewards": rewards,
            "warm_rewards": warm, "sequence_tokens": sequence_tokens}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0))))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="Largest reward difference allowed (default 1e-4 on CPU, 0.05 on CUDA).")
    parser.add_argument("--worker", choices=["stock", "ours"])
    parser.add_argument("--path")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "reward_function.json"))
    cli = parser.parse_args()
    if cli.worker:
        print(json.dumps(worker(cli.path, cli.worker, cli)))
        return

    import torch

    from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model

    cuda = cli.device == "cuda"
    model = MODEL_CUDA if cuda else MODEL
    tolerance = cli.tolerance if cli.tolerance is not None else (0.05 if cuda else 1e-4)
    with tempfile.TemporaryDirectory() as root, torch.device(cli.device):  # built where it runs: fast init
        tokenizer = build_chat_tokenizer()
        path = save_tiny_model(Path(root) / "disrm", task="seq-cls", tokenizer=tokenizer, seed=0,
                               max_position_embeddings=4 * cli.prompt_tokens,
                               **({"dtype": torch.bfloat16} if cuda else {}), **model)  # fmt: skip
        save_tiny_model(Path(root) / "policy", tokenizer=tokenizer, seed=1)
        results = {}
        for which in ("stock", "ours"):
            command = [sys.executable, __file__, "--worker", which, "--path", path,
                       *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in vars(cli).items()
                             if k in ("prompt_tokens", "completion_tokens", "generations", "repeats", "threads",
                                      "device")),
                            [])]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": str(cli.threads), "OMP_WAIT_POLICY": "PASSIVE"}
            out = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
            results[which] = json.loads(out.strip().splitlines()[-1])
    stock, ours = results["stock"], results["ours"]
    difference = max(abs(a - b) for a, b in zip(stock["rewards"], ours["rewards"]))
    if difference > tolerance:
        raise SystemExit(f"the rewards differ by {difference:.2e} (stock {stock['rewards']}, ours {ours['rewards']})")
    report = {
        "reward_g8_speedup": round(stock["seconds"] / ours["seconds"], 2),
        "reward_g8_peak_mem_ratio": round(ours["peak_added_mib"] / max(stock["peak_added_mib"], 1e-9), 3),
        "stock_seconds": round(stock["seconds"], 3),
        "ours_seconds": round(ours["seconds"], 3),
        "stock_peak_added_mib": round(stock["peak_added_mib"], 1),
        "ours_peak_added_mib": round(ours["peak_added_mib"], 1),
        "max_reward_difference": difference,
        "sequence_tokens": stock["sequence_tokens"],
        "generations": cli.generations,
        "threads": cli.threads,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model": model,
    }
    Path(cli.output).parent.mkdir(parents=True, exist_ok=True)
    Path(cli.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
