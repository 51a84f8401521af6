"""Run from vLLM's venv (where verl 0.9.1 and OpenRLHF 0.11.2 are installed) by tests/test_rl_frameworks.py: our
reward code driven by verl's and OpenRLHF's own calling code, one process for every job (the imports cost more than the
jobs), printing one JSON line `RESULT {job name: result}`.

    python tests/rl_frameworks_worker.py JOBS_JSON POLICY SAMPLES_JSON

JOBS_JSON: a list of {"name", "kind", "remote" (OpenRLHF's --reward.remote_url), "env" (set for the job), "samples"
(a samples file of the job's own)}; kinds: `verl-manager` (JudgeRewardManager in verl's reward loop), `verl-function`
(compute_score in verl's naive manager), `openrlhf` (OpenRLHF's single-turn executor), and at a real step's scale
`verl-scale` (every sample of a batch at once over verl's default 8 reward workers), `openrlhf-scale` (every sample
at once through OpenRLHF's executor, prompts cut from the front by it), `verl-slots` (a step too large for verl's
reward workers, refused). SAMPLES_JSON: {"prompts": [messages...], "responses": [[text, ...] per
prompt]}. verl: every sample is scored by `RewardLoopWorker.compute_score` on a worker picked at random among 2 (as
verl's agent loop streams rewards), and the whole batch by `compute_score_batch` in chunks that split groups (as
`RewardLoopManager.compute_rm_score` deals it out). OpenRLHF: each prompt's samples by `SingleTurnAgentExecutor.execute`,
all at once (as `generate_responses` runs them); the policy's generation is a stand-in returning the given responses'
token ids (the reward path is what is tested).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's trl_longrm, before the venv's


def verl_config(policy: str, manager: str, n: int = 4, prompts: int | None = None):
    import verl
    from omegaconf import OmegaConf

    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    from verl.experimental.reward_loop.reward_loop import migrate_legacy_reward_impl

    config.actor_rollout_ref.model.path = policy
    config.actor_rollout_ref.rollout.n = n
    config.actor_rollout_ref.rollout.val_kwargs.n = n
    if prompts is not None:
        config.data.train_batch_size = prompts
    config.reward_model.enable = False
    config = migrate_legacy_reward_impl(config)
    if manager in ("verl-manager", "verl-scale", "verl-slots"):
        config.reward.reward_manager.source = "importlib"
        config.reward.reward_manager.name = "JudgeRewardManager"
        config.reward.reward_manager.module.path = str(ROOT / "trl_longrm" / "rewards" / "verl.py")
    else:
        config.reward.custom_reward_function.path = str(ROOT / "trl_longrm" / "rewards" / "verl.py")
        config.reward.custom_reward_function.name = "compute_score"
    return config


def verl_batch(policy: str, samples: dict):
    import numpy as np
    import torch
    from transformers import AutoTokenizer
    from verl import DataProto

    tokenizer = AutoTokenizer.from_pretrained(policy)
    rows = []
    for g, (prompt, responses) in enumerate(zip(samples["prompts"], samples["responses"])):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for response in responses:
            rows.append((g, prompt, prompt_ids, tokenizer(response, add_special_tokens=False)["input_ids"]))
    width_p, width_r = max(len(r[2]) for r in rows), max(len(r[3]) + 1 for r in rows)
    pad = tokenizer.pad_token_id or 0
    prompts = torch.full((len(rows), width_p), pad)
    responses = torch.full((len(rows), width_r), pad)
    mask = torch.zeros((len(rows), width_p + width_r), dtype=torch.long)
    for i, (_, _, p, r) in enumerate(rows):
        r = r + [tokenizer.eos_token_id]  # the policy's EOS ends the response, as vLLM returns it
        prompts[i, width_p - len(p) :] = torch.tensor(p)  # verl left-pads prompts, right-pads responses
        responses[i, : len(r)] = torch.tensor(r)
        mask[i, width_p - len(p) : width_p + len(r)] = 1
    obj = lambda values: np.array(values + [None], dtype=object)[:-1]  # noqa: E731 - an array of objects
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask,
                 "input_ids": torch.cat([prompts, responses], dim=1)},
        non_tensors={
            "raw_prompt": obj([r[1] for r in rows]),
            "uid": np.array([f"uid-{r[0]}" for r in rows], dtype=object),
            "data_source": np.array(["longrm"] * len(rows), dtype=object),
            "reward_model": obj([{"ground_truth": ""} for _ in rows]),
            "extra_info": obj([{"prompt": r[1]} for r in rows]),
        },
    )  # fmt: skip


async def run_verl(kind: str, policy: str, samples: dict) -> dict:
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    config = verl_config(policy, kind)
    workers = [RewardLoopWorker(config, None) for _ in range(2)]  # verl makes them Ray actors; same code in process
    data = verl_batch(policy, samples)
    rng = random.Random(0)
    # Streaming: each sample to a worker picked at random, all in flight together (the agent loop's `_compute_score`).
    streamed = await asyncio.gather(*[rng.choice(workers).compute_score(data[i : i + 1]) for i in range(len(data))])
    # Batch: chunks of 3 samples (groups of 4 split over the workers), each worker scoring its chunk sample by sample.
    chunks = [data[i : i + 3] for i in range(0, len(data), 3)]
    batched = await asyncio.gather(*[workers[c % 2].compute_score_batch(chunk) for c, chunk in enumerate(chunks)])
    return {"streamed": [o["reward_score"] for o in streamed],
            "batched": [o["reward_score"] for chunk in batched for o in chunk],
            "extra": [o.get("reward_extra_info", {}) for o in streamed]}  # fmt: skip


async def run_openrlhf(remote: str, policy: str, samples: dict) -> dict:
    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(policy)
    executor = SingleTurnAgentExecutor(remote_rm_url=[remote])
    results = []
    for prompt, responses in zip(samples["prompts"], samples["responses"]):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        engine = StandInEngine(tokenizer, responses)
        # OpenRLHF's `generate_responses`: the prompt's n samples executed together.
        outputs = await asyncio.gather(*[
            executor.execute(prompt=text, label="", sampling_params=SamplingParams(max_tokens=32), max_length=4096,
                             hf_tokenizer=tokenizer, llm_engine=engine)
            for _ in responses
        ])  # fmt: skip
        results.append([{"reward": _number(o["reward"]), "scores": _number(o["scores"]),
                         "extra_logs": {k: _number(v) for k, v in (o["extra_logs"] or {}).items()}} for o in outputs])
    return {"rewards": results}


async def run_verl_scale(policy: str, samples: dict) -> dict:
    """verl's streaming reward path at a real step's scale: every sample of the batch sent at once to one of verl's
    default 8 reward workers picked at random (`agent_loop.py`'s `_compute_score`), each worker running at most 1,000
    calls at a time as Ray runs an async actor (its default `max_concurrency`; the workers run here in one process,
    the limit by a semaphore each)."""
    import time

    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    n = len(samples["responses"][0])
    config = verl_config(policy, "verl-scale", n=n, prompts=len(samples["prompts"]))
    workers = [RewardLoopWorker(config, None) for _ in range(int(config.reward.num_workers))]
    slots = [asyncio.Semaphore(1000) for _ in workers]
    data = verl_batch(policy, samples)
    rng = random.Random(0)

    async def on_worker(index: int):
        w = rng.randrange(len(workers))
        async with slots[w]:
            return await workers[w].compute_score(data[index : index + 1])

    order = list(range(len(data)))
    rng.shuffle(order)  # samples finish generating in any order
    started = time.monotonic()
    outputs = await asyncio.gather(*[on_worker(i) for i in order])
    seconds = time.monotonic() - started
    by_index = dict(zip(order, outputs))
    return {"rewards": [by_index[i]["reward_score"] for i in range(len(data))],
            "unscored": sum(by_index[i]["reward_extra_info"]["judge_unscored"] for i in range(len(data))),
            "workers": len(workers), "seconds": seconds}  # fmt: skip


def run_verl_slots(policy: str) -> dict:
    """A step verl's default reward workers cannot hold (2,048 prompts x 8 samples): refused when the manager is
    built, naming the setting."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    try:
        RewardLoopWorker(verl_config(policy, "verl-slots", n=8, prompts=2048), None)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


async def run_openrlhf_scale(remote: str, policy: str, samples: dict, max_length: int) -> dict:
    """OpenRLHF's `SingleTurnAgentExecutor` for every sample of a batch at once (its `generate_responses` gathers them
    all), prompts longer than `max_length` - 32 tokens cut from the front by OpenRLHF itself."""
    import time

    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(policy)
    executor = SingleTurnAgentExecutor(remote_rm_url=[remote])
    jobs, cut = [], 0
    for prompt, responses in zip(samples["prompts"], samples["responses"]):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        cut += len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_length - 32
        engine = StandInEngine(tokenizer, responses)
        jobs += [executor.execute(prompt=text, label="", sampling_params=SamplingParams(max_tokens=32),
                                  max_length=max_length, hf_tokenizer=tokenizer, llm_engine=engine)
                 for _ in responses]  # fmt: skip
    started = time.monotonic()
    outputs = await asyncio.gather(*jobs)
    return {"rewards": [_number(o["reward"]) for o in outputs], "prompts_cut": cut,
            "seconds": time.monotonic() - started}  # fmt: skip


class StandInEngine:
    """The policy's vLLM engine for OpenRLHF's executor: returns one prompt's given responses in turn (the reward
    path is what is tested)."""

    def __init__(self, tokenizer, responses):
        self.tokenizer, self.queue = tokenizer, list(responses)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        text = self.queue.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        output = type("Output", (), {"token_ids": ids, "finish_reason": "stop", "logprobs": None})()
        return type("RequestOutput", (), {"outputs": [output]})()


def _number(value):
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value[0] if isinstance(value, list) else value


if __name__ == "__main__":
    import os

    jobs = json.loads(Path(sys.argv[1]).read_text())
    policy, samples = sys.argv[2], json.loads(Path(sys.argv[3]).read_text())
    results = {}
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # thousands of connections at once, as in a real step
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    for job in jobs:
        os.environ.update(job.get("env", {}))
        job_samples = json.loads(Path(job["samples"]).read_text()) if "samples" in job else samples
        if job["kind"] == "openrlhf":
            results[job["name"]] = asyncio.run(run_openrlhf(job["remote"], policy, job_samples))
        elif job["kind"] == "openrlhf-scale":
            results[job["name"]] = asyncio.run(run_openrlhf_scale(job["remote"], policy, job_samples,
                                                                  job["max_length"]))  # fmt: skip
        elif job["kind"] == "verl-scale":
            results[job["name"]] = asyncio.run(run_verl_scale(policy, job_samples))
        elif job["kind"] == "verl-slots":
            results[job["name"]] = run_verl_slots(policy)
        else:
            results[job["name"]] = asyncio.run(run_verl(job["kind"], policy, samples))
    print("RESULT " + json.dumps(results), flush=True)
