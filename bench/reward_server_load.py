"""`trl-longrm reward-server` at the load RL frameworks put on it: verl-style clients (a new connection per sample,
`{uid, group_size, prompt, response}` to `/verl`, as `JudgeRewardManager` posts) and OpenRLHF-style clients (a new
connection per sample, `{query, prompts, labels}` to `/get_reward`, a 180 s timeout and 5 tries, as OpenRLHF's
`SingleTurnAgentExecutor` posts), every sample of a batch at once, against a stand-in judge server with a fixed
latency per request (`tests/judge_stand_in.py`, verdicts known in advance: every reward is checked).

For each client kind and connection count (one sample per connection): throughput, latency p50 / p99 (post to
answer), connections reset or refused, lost and wrong rewards, the server's CPU per sample, its overhead (the time it
took past a perfect server's, which judges each group the moment its client sent its last sample, `--latency`
seconds a request, `--max-concurrency` at once; as a share of the judge's own time, `ceil(requests / concurrency) x
latency`), and its RSS before and after; with `--duration S` the batches repeat for S seconds and the RSS is
sampled after each (flat: no growth per batch). The judge, the server and the clients are three processes.

    python bench/reward_server_load.py                                # 1,024 and 4,096 connections, both clients
    python bench/reward_server_load.py --connections 4096 --duration 600 --clients verl   # RSS over 10 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import judge_steering  # noqa: E402
from reward_server_helpers import judge_process, raise_fd_limit, server_process  # noqa: E402


def batch(index: int, groups: int, size: int) -> list[dict]:
    """`groups` prompts x `size` responses, distinct per batch; each sample with its group and expected reward."""
    samples = []
    for g in range(groups):
        prompt = [{"role": "user", "content": f"Batch {index} question {g}: which river? " + "Context. " * 30}]
        responses = [f"Answer {index}-{g}-{j}: " + "river " * (1 + j % 4) for j in range(size)]
        for response, reward in zip(responses, judge_steering.expected_ranking(responses)):
            samples.append({"uid": f"b{index}-g{g}", "prompt": prompt, "response": response, "expected": reward})
    random.Random(index).shuffle(samples)  # samples finish generating in any order
    return samples


async def verl_client(url: str, sample: dict, size: int) -> tuple[float | None, str | None]:
    import aiohttp

    payload = {"uid": sample["uid"], "group_size": size, "prompt": sample["prompt"], "response": sample["response"]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.post(f"{url}/verl", json=payload) as answer:
            body = await answer.json(content_type=None)
            return (body["score"], None) if answer.status == 200 else (None, f"{answer.status}")


async def openrlhf_client(url: str, sample: dict, size: int, tokenizer) -> tuple[float | None, str | None]:
    import aiohttp

    text = tokenizer.apply_chat_template(sample["prompt"], add_generation_prompt=True, tokenize=False)
    payload = {"query": [text + sample["response"] + tokenizer.eos_token], "prompts": [text], "labels": [""]}
    errors = []
    for _ in range(5):  # OpenRLHF's `_post_request`: 5 tries, 1 s apart, 180 s each
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
                async with session.post(f"{url}/get_reward", json=payload) as answer:
                    answer.raise_for_status()
                    return (await answer.json())["rewards"], None
        except Exception as error:  # noqa: BLE001 - OpenRLHF catches everything and tries again
            errors.append(type(error).__name__)
        await asyncio.sleep(1)
    return None, ",".join(errors)


def perfect_server_seconds(samples: list[dict], sent: list[float], start: float, latency: float, slots: int) -> float:
    """When a perfect server would answer the batch's last sample: each group judged (one ranking request of
    `latency` seconds, at most `slots` at once, first come first served) as soon as its client sent its last
    sample, answered at once. The clients' own pace is not the server's overhead; the rest is."""
    import heapq

    whole: dict[str, float] = {}
    for sample, at in zip(samples, sent):
        whole[sample["uid"]] = max(whole.get(sample["uid"], 0.0), at)
    free = [start] * slots
    finish = start
    for ready in sorted(whole.values()):
        begin = max(ready, heapq.heappop(free))
        heapq.heappush(free, begin + latency)
        finish = max(finish, begin + latency)
    return finish - start


async def run_batch(url: str, kind: str, samples: list[dict], size: int, tokenizer) -> dict:
    latencies, failures = [], []
    sent = [0.0] * len(samples)

    async def one(k, sample):
        started = time.monotonic()
        sent[k] = started
        try:
            if kind == "verl":
                reward, failure = await verl_client(url, sample, size)
            else:
                reward, failure = await openrlhf_client(url, sample, size, tokenizer)
        except Exception as error:  # a reset or refused connection
            reward, failure = None, type(error).__name__
        latencies.append(time.monotonic() - started)
        if failure:
            failures.append(failure)
        return reward

    started = time.monotonic()
    rewards = await asyncio.gather(*(one(k, s) for k, s in enumerate(samples)))
    seconds = time.monotonic() - started
    wrong = sum(r is not None and abs(r - s["expected"]) > 1e-9 for r, s in zip(rewards, samples))
    latencies.sort()
    return {"seconds": seconds, "samples_per_s": len(samples) / seconds,
            "sent": sent, "start": started,
            "p50_s": statistics.median(latencies), "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "lost": sum(r is None for r in rewards), "wrong": wrong,
            "resets": sum("Connect" in f or "Reset" in f or "Disconnected" in f for f in failures),
            "failures": sorted(set(failures))[:5]}  # fmt: skip


def rss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--clients", nargs="+", default=["verl", "openrlhf"], choices=["verl", "openrlhf"])
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--latency", type=float, default=1.0, help="Seconds per judge request (the stand-in's).")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=0.0, help="Repeat batches for this long (RSS over time).")
    parser.add_argument("--out", default=None, help="Write the results here as JSON too.")
    args = parser.parse_args()
    limit = raise_fd_limit(65536)
    if limit < 2 * max(args.connections) + 256:
        sys.exit(f"This process may open {limit} files; {2 * max(args.connections) + 256} are needed (ulimit -Hn).")
    from transformers import AutoTokenizer

    from trl_longrm.testing_utils import build_chat_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="reward-server-load-"))
    build_chat_tokenizer().save_pretrained(folder / "judge")
    tokenizer = AutoTokenizer.from_pretrained(folder / "judge")
    results = {"latency_s": args.latency, "max_concurrency": args.max_concurrency, "group_size": args.group_size,
               "protocol": "ranking", "runs": []}  # fmt: skip
    with judge_process(str(folder / "judge"), latency=args.latency) as (judge_url, _):
        flags = ["--protocol", "ranking", "--group-size", str(args.group_size), "--max-concurrency",
                 str(args.max_concurrency), "--max-new-tokens", "64", "--log-level", "warning"]  # fmt: skip
        with server_process(judge_url, str(folder / "judge"), *flags, log_path=folder / "server.log") as (proc, url, _):
            index = 0
            for connections in args.connections:
                for kind in args.clients:
                    groups = connections // args.group_size
                    requests = groups  # ranking: one judge request a group
                    ideal = math.ceil(requests / args.max_concurrency) * args.latency
                    rss_before = rss_mib(proc.pid)
                    cpu_before = cpu_seconds(proc.pid)
                    deadline = time.monotonic() + args.duration
                    batches, rss = [], []
                    while True:
                        samples = batch(index, groups, args.group_size)
                        index += 1
                        result = asyncio.run(run_batch(url, kind, samples, args.group_size, tokenizer))
                        result["perfect_s"] = perfect_server_seconds(samples, result.pop("sent"), result.pop("start"),
                                                                     args.latency, args.max_concurrency)  # fmt: skip
                        batches.append(result)
                        rss.append(round(rss_mib(proc.pid), 1))
                        if time.monotonic() >= deadline:
                            break
                    server_cpu = (cpu_seconds(proc.pid) - cpu_before) / len(batches)
                    first = batches[0]
                    run = {"client": kind, "connections": connections, "batches": len(batches),
                           **{k: first[k] for k in ("samples_per_s", "p50_s", "p99_s")},
                           "seconds": round(statistics.median(b["seconds"] for b in batches), 3),
                           "judge_rounds_s": ideal, "perfect_server_s": round(statistics.median(b["perfect_s"] for b in batches), 3),
                           "server_cpu_s": round(server_cpu, 3),
                           "server_cpu_ms_per_sample": round(1000 * server_cpu / (groups * args.group_size), 3),
                           # What the server added over a perfect one, as a share of the judge's own time.
                           "overhead": round(statistics.median(b["seconds"] - b["perfect_s"] for b in batches) / ideal, 4)
                           if ideal else None,
                           "resets": sum(b["resets"] for b in batches), "lost": sum(b["lost"] for b in batches),
                           "wrong": sum(b["wrong"] for b in batches), "failures": first["failures"],
                           "rss_mib_before": round(rss_before, 1), "rss_mib_after": rss[-1],
                           "rss_mib_per_batch": rss if len(rss) <= 50 else rss[:: max(1, len(rss) // 50)]}  # fmt: skip
                    results["runs"].append(run)
                    print(json.dumps(run), flush=True)
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
                text = answer.read().decode()
            for name in ("judge_seconds_sum", "judge_seconds_count", "request_seconds_sum", "request_seconds_count"):
                results[f"server_{name}"] = sum(float(line.split()[-1]) for line in text.splitlines()
                                                if line.startswith(f"trl_longrm_reward_server_{name}"))  # fmt: skip
            results["server_partial_groups"] = sum(float(line.split()[-1]) for line in text.splitlines()
                                                   if line.startswith('trl_longrm_reward_server_groups_total{outcome="partial"}'))  # fmt: skip
    results["fd_limit"] = limit
    results["somaxconn"] = int(Path("/proc/sys/net/core/somaxconn").read_text()) if Path("/proc/sys/net/core/somaxconn").exists() else None
    print(json.dumps(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE))
    main()
