"""The generative judge of `trl_longrm.rewards.judge` in OpenRLHF (0.11: `--reward.remote_url`, the samples per prompt
`--rollout.n_samples_per_prompt`). OpenRLHF asks for one sample's reward at a time (its single-turn executor, for each
generated sample), by one of two routes:

- an HTTP URL: `trl-longrm reward-server` (`trl_longrm.rewards.server`) holds each sample until its prompt's
  `--group-size` samples have arrived, judges them as one group (pairwise, ranking or pointwise) and answers each;
- a `.py` path: this file's `reward_func(queries, prompts, labels)`, called with one sample, judges it alone: the
  pointwise protocol only (`TRL_LONGRM_JUDGE_PROTOCOL=pointwise`, settings from the `TRL_LONGRM_JUDGE_*` environment,
  `trl_longrm.rewards.judge.ENVIRONMENT`).

Each query is the prompt followed by the response, decoded with special tokens; the prompt the text the policy saw
(rendered by its chat template with `--data.apply_chat_template`, and then the judge reads that text as the task). The
response is the query after its prompt, without trailing special tokens of the judge's tokenizer.

OpenRLHF catches any exception of a reward call and logs it at INFO ("Failed to fetch reward from remote RM"), then
stops on the missing reward with "reward_model_group is required": `reward_func` logs its error at ERROR first (the
`trl_longrm.rewards.openrlhf` logger, on stderr), so that the cause reaches the user. Example:
```bash
export TRL_LONGRM_JUDGE_URL=http://127.0.0.1:8000/v1 TRL_LONGRM_JUDGE_MODEL=judge \
       TRL_LONGRM_JUDGE_TOKENIZER=./LongReward_Qwen3-8B TRL_LONGRM_JUDGE_PROTOCOL=pointwise
python -m openrlhf.cli.train_ppo_ray ... --rollout.n_samples_per_prompt 8 \
    --reward.remote_url $(python -c "import trl_longrm.rewards.openrlhf as m; print(m.__file__)")
```
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import torch

from trl_longrm.rewards.judge import judge_reward_from_env
from trl_longrm.rewards.server.payloads import openrlhf_response


# A fixed name: OpenRLHF loads this file as a module named `reward_func`.
logger = logging.getLogger("trl_longrm.rewards.openrlhf")
if not logger.handlers:  # OpenRLHF configures only its own loggers: ours must print by itself
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(_handler)


def _rewards(queries: Sequence[str], prompts: Sequence[str]) -> dict:
    reward = judge_reward_from_env()
    if reward.protocol != "pointwise" and len(set(prompts)) == len(prompts):
        raise ValueError(
            f"The {reward.protocol} judge compares a prompt's samples, but OpenRLHF called reward_func with "
            f"{len(prompts)} sample(s) of {len(prompts)} different prompt(s): nothing to compare. With a .py "
            "--reward.remote_url set TRL_LONGRM_JUDGE_PROTOCOL=pointwise; to judge groups, run `trl-longrm "
            "reward-server --group-size N` and pass its URL as --reward.remote_url."
        )
    special = sorted(reward.judge.tokenizer.all_special_tokens, key=len, reverse=True)
    responses = [openrlhf_response(q, p, special) for q, p in zip(queries, prompts, strict=True)]
    logs: dict[str, float] = {}
    rewards = reward.rewards(list(prompts), responses, log_metric=logs.__setitem__)
    if any(r is None for r in rewards):
        raise ValueError(
            f"The judge gave no reward to {sum(r is None for r in rewards)} of {len(rewards)} sample(s) (a request "
            "refused, or a judgment without a score: see the trl_longrm.rewards.judge warning); OpenRLHF takes no "
            "missing reward."
        )
    values = torch.tensor(rewards, dtype=torch.float32)
    low, high = reward.judge.template.pointwise_format.scale if reward.protocol == "pointwise" else (0, 1)
    return {
        "rewards": values,
        "scores": (values - low) / (high - low),
        "extra_logs": {key: torch.tensor(value) for key, value in logs.items()},
    }


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence | None = None) -> dict:
    """OpenRLHF's reward-function result: `rewards` (a float tensor, one per query: `JudgeReward`'s score, win rate
    or rank), `scores` (the same rescaled to [0, 1], what `--dynamic_filtering` reads) and `extra_logs`
    (`judge/unparsed_verdicts`, ...). An error is logged at ERROR before it is raised (OpenRLHF hides it)."""
    try:
        return _rewards(queries, prompts)
    except Exception as error:
        logger.error("trl_longrm reward_func: %s: %s", type(error).__name__, error)
        raise
