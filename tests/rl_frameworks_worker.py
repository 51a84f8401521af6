"""Run from vLLM's venv (where verl 0.9.1 and OpenRLHF 0.11.2 are installed) by tests/test_rl_frameworks.py: our
reward code driven by verl's and OpenRLHF's own calling code, one process for every job (the imports cost more than the
jobs), printing one JSON line `RESULT {job name: result}`.

    python tests/rl_frameworks_worker.py JOBS_JSON POLICY SAMPLES_JSON

JOBS_JSON: a list of {"name", "kind", "remote" (OpenRLHF's --reward.remote_url), "env" (set for the job)}; kinds:
`verl-manager` (JudgeRewardManager in verl's reward loop), `verl-function` (compute_score in verl's naive manager),
`openrlhf` (OpenRLHF's single-turn executor). SAMPLES_JSON: {"prompts": [messages...], "responses": [[text, ...] per
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


def verl_config(policy: str, manager: str):
    import verl
    from omegaconf import OmegaConf

    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    from verl.experimental.reward_loop.reward_loop import migrate_legacy_reward_impl

    config.actor_rollout_ref.model.path = policy
    config.actor_rollout_ref.rollout.n = 4
    config.actor_rollout_ref.rollout.val_kwargs.n = 4
    config.reward_model.enable = False
    config = migrate_legacy_reward_impl(config)
    if manager == "verl-manager":
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

    class Output:
        def __init__(self, token_ids):
            self.token_ids, self.finish_reason, self.logprobs = token_ids, "stop", None

    class StandInEngine:  # the policy's vLLM engine: returns each prompt's given responses in turn
        def __init__(self, responses):
            self.queue = list(responses)

        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            text = self.queue.pop(0)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            return type("RequestOutput", (), {"outputs": [Output(ids)]})()

    results = []
    for prompt, responses in zip(samples["prompts"], samples["responses"]):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        engine = StandInEngine(responses)
        # OpenRLHF's `generate_responses`: the prompt's n samples executed together.
        outputs = await asyncio.gather(*[
            executor.execute(prompt=text, label="", sampling_params=SamplingParams(max_tokens=32), max_length=4096,
                             hf_tokenizer=tokenizer, llm_engine=engine)
            for _ in responses
        ])  # fmt: skip
        results.append([{"reward": _number(o["reward"]), "scores": _number(o["scores"]),
                         "extra_logs": {k: _number(v) for k, v in (o["extra_logs"] or {}).items()}} for o in outputs])
    return {"rewards": results}


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
    for job in jobs:
        os.environ.update(job.get("env", {}))
        if job["kind"] == "openrlhf":
            results[job["name"]] = asyncio.run(run_openrlhf(job["remote"], policy, samples))
        else:
            results[job["name"]] = asyncio.run(run_verl(job["kind"], policy, samples))
    print("RESULT " + json.dumps(results), flush=True)
