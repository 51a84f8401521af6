"""The generative judge of `trl_longrm.rewards.judge` as verl's custom reward function, for its batch reward manager.

verl calls `compute_score` once per batch with lists (its `BatchRewardManager`): the data sources, the decoded
responses (`solution_strs`), the ground truths and each row's `extra_info`. The responses of one prompt are judged
together, so the prompt must travel in `extra_info`: when preparing the parquet data, put the prompt there as
`extra_info["prompt"]` (the chat messages, a list of `{"role", "content"}`, as in the `prompt` column, or a plain
string). Rows with equal prompts form a group (verl lays a prompt's `rollout.n` responses consecutively).

The judge's server and protocol come from the `TRL_LONGRM_JUDGE_*` environment variables of the reward workers
(`trl_longrm.rewards.judge.ENVIRONMENT`). Example:
```bash
export TRL_LONGRM_JUDGE_URL=http://127.0.0.1:8000/v1 TRL_LONGRM_JUDGE_MODEL=judge \
       TRL_LONGRM_JUDGE_TOKENIZER=./LongReward_Qwen3-8B TRL_LONGRM_JUDGE_PROTOCOL=pairwise
python -m verl.trainer.main_ppo ... reward_model.reward_manager=batch \
    custom_reward_function.path=$(python -c "import trl_longrm.rewards.verl as m; print(m.__file__)") \
    custom_reward_function.name=compute_score
```
"""

from __future__ import annotations

from collections.abc import Sequence

from trl_longrm.rewards.judge import judge_reward_from_env


def compute_score(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence,
    extra_infos: Sequence[dict | None],
    **kwargs,
) -> list[float]:
    """One reward per response, in order: `JudgeReward`'s rule (win rate, rank or score) with the prompts read from
    `extra_infos[i]["prompt"]`; the data sources and ground truths are not read (the judge compares responses)."""
    prompts = []
    for index, extra in enumerate(extra_infos):
        prompt = (extra or {}).get("prompt") if hasattr(extra, "get") or extra is None else None
        if prompt is None:
            raise ValueError(
                f"Row {index}: its extra_info has no 'prompt'. The judge groups responses by prompt; put the prompt "
                "(messages or text) in each row's extra_info['prompt'] when preparing verl's data."
            )
        # Messages may come back from parquet as numpy arrays of dicts.
        prompts.append(prompt if isinstance(prompt, str) else [dict(m) for m in prompt])
    return judge_reward_from_env().rewards(prompts, list(solution_strs))
