"""The generative judge of `trl_longrm.rewards.judge` as OpenRLHF's reward function file (`--remote_rm_url` given a
`.py` path; newer releases name the flag `--reward_func`).

OpenRLHF calls `reward_func(queries, prompts, labels)` with a batch's texts: each query is the prompt followed by the
response, each prompt the prompt text as the policy saw it (rendered by its chat template with
`--apply_chat_template`, so the judge then reads that text as the task), labels from `--label_key` (not read). The
response is the query after its prompt, without trailing special tokens of the judge's tokenizer (OpenRLHF may keep
the policy's end-of-turn token in the query). Rows with equal prompts form a group (OpenRLHF lays a prompt's
`--n_samples_per_prompt` samples consecutively).

Pairwise and ranking judge a group's samples together, so they need the whole group in one call: releases that call
the function on chunks of `--micro_rollout_batch_size` samples need it a multiple of `--n_samples_per_prompt`, and
recent releases (the single-turn and agent executors) call it once per sample, where only `pointwise` can work
(`TRL_LONGRM_JUDGE_PROTOCOL=pointwise`). A pairwise or ranking call whose groups are all single samples is refused
with a `ValueError` saying so, not rewarded a constant 0.5.

The judge's server and protocol come from the `TRL_LONGRM_JUDGE_*` environment variables
(`trl_longrm.rewards.judge.ENVIRONMENT`) of the process that loads this file. Example:
```bash
export TRL_LONGRM_JUDGE_URL=http://127.0.0.1:8000/v1 TRL_LONGRM_JUDGE_MODEL=judge \
       TRL_LONGRM_JUDGE_TOKENIZER=./LongReward_Qwen3-8B
python -m openrlhf.cli.train_ppo_ray ... --n_samples_per_prompt 8 \
    --remote_rm_url $(python -c "import trl_longrm.rewards.openrlhf as m; print(m.__file__)")
```
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trl_longrm.rewards.judge import judge_reward_from_env


def _response(query: str, prompt: str, special: list[str]) -> str:
    response = query[len(prompt) :] if query.startswith(prompt) else query
    stripped = True
    while stripped:
        stripped = False
        response = response.rstrip()
        for token in special:
            if token and response.endswith(token):
                response = response[: -len(token)]
                stripped = True
    return response


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence | None = None) -> dict:
    """OpenRLHF's reward-function result for a batch: `rewards` (a float tensor, one per query: `JudgeReward`'s win
    rate, rank or score), `scores` (the same rescaled to [0, 1], what `--dynamic_filtering` reads) and `extra_logs`
    (`judge/unparsed_verdicts`, `judge/unparsed_fraction`)."""
    reward = judge_reward_from_env()
    if reward.protocol != "pointwise" and len(set(prompts)) == len(prompts):
        raise ValueError(
            f"The {reward.protocol} judge compares a prompt's samples, but this call holds {len(prompts)} sample(s) of "
            f"{len(prompts)} different prompt(s): every reward would be 0.5. OpenRLHF calling reward_func once per "
            "sample needs TRL_LONGRM_JUDGE_PROTOCOL=pointwise; a release batching --micro_rollout_batch_size samples "
            "needs it a multiple of --n_samples_per_prompt."
        )
    special = sorted(reward.judge.tokenizer.all_special_tokens, key=len, reverse=True)
    responses = [_response(q, p, special) for q, p in zip(queries, prompts, strict=True)]
    logs: dict[str, float] = {}
    rewards = reward.rewards(list(prompts), responses, log_metric=logs.__setitem__)
    values = torch.tensor(rewards, dtype=torch.float32)
    low, high = reward.judge.template.pointwise_format.scale if reward.protocol == "pointwise" else (0, 1)
    return {
        "rewards": values,
        "scores": (values - low) / (high - low),
        "extra_logs": {key: torch.tensor(value) for key, value in logs.items()},
    }
