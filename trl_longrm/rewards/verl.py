"""The generative judge of `trl_longrm.rewards.judge` in verl's reward loop (verl 0.9: `RewardLoopWorker` asks a reward
manager for one sample at a time, `run_single`, from several workers).

- `JudgeRewardManager`, a verl reward manager loaded by module (`reward.reward_manager.source=importlib`): each sample
  is sent to `trl-longrm reward-server` (`TRL_LONGRM_REWARD_SERVER`, its address), which holds it until its group (the
  samples sharing verl's `uid`, `actor_rollout_ref.rollout.n` of them) is whole, judges the group once and answers each
  sample: pairwise and ranking see every group whole, whatever worker each sample reached.
- `compute_score`, a custom reward function for verl's `naive` manager (`custom_reward_function.path`), called per
  sample with keyword arguments: a pointwise judgment of the one sample, from the `TRL_LONGRM_JUDGE_*` environment
  (`trl_longrm.rewards.judge.ENVIRONMENT`); a pairwise or ranking judge is refused there (one sample, nothing to
  compare).

The judge reads the sample's prompt from verl's `raw_prompt` (the chat messages of the data's `prompt` column) and its
response decoded by the policy's tokenizer without special tokens, as verl's own managers decode it. verl takes no
"no reward": an unscored sample gets its group's mean reward (no advantage against a group baseline), counted in the
`judge_unscored` extra info. Example:
```bash
trl-longrm reward-server --base-url http://127.0.0.1:8000/v1 --served-model judge --tokenizer ./LongReward_Qwen3-8B \
    --protocol pairwise --group-size 8 --port 5000 &
TRL_LONGRM_REWARD_SERVER=http://127.0.0.1:5000 python -m verl.trainer.main_ppo ... actor_rollout_ref.rollout.n=8 \
    reward.reward_manager.source=importlib reward.reward_manager.name=JudgeRewardManager \
    reward.reward_manager.module.path=$(python -c "import trl_longrm.rewards.verl as m; print(m.__file__)")
```
"""

from __future__ import annotations

import logging
import os


logger = logging.getLogger(__name__)

try:  # verl is there when verl loads this module; importing it elsewhere (docs, tests of compute_score) needs none
    from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
except ImportError:  # pragma: no cover - exercised where verl is installed
    RewardManagerBase = object


def _messages(prompt):
    """verl's `raw_prompt` (a numpy array or list of message dicts, or text) as plain messages or text."""
    if isinstance(prompt, str):
        return prompt
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in list(prompt)]


def _sample(data, tokenizer):
    """A one-sample `DataProto`'s prompt messages, decoded response and uid, as verl's `naive` manager reads them."""
    item = data[-1:][0]  # verl's managers score the last sequence of a multi-sequence output
    response_ids = item.batch["responses"]
    valid = int(item.batch["attention_mask"][-response_ids.shape[-1] :].sum())
    response = tokenizer.decode(response_ids[:valid], skip_special_tokens=True)
    non_tensor = item.non_tensor_batch
    if "raw_prompt" not in non_tensor:
        raise ValueError("verl's sample has no `raw_prompt`: the judge reads the prompt's messages from it.")
    return _messages(non_tensor["raw_prompt"]), response, str(non_tensor.get("uid", ""))


class JudgeRewardManager(RewardManagerBase):
    """verl reward manager: each sample's reward from `trl-longrm reward-server` (address in the
    `TRL_LONGRM_REWARD_SERVER` environment variable of verl's reward workers), which judges each `uid` group whole.

    The group size sent is `actor_rollout_ref.rollout.n`; validation samples (`val_kwargs.n` per prompt) form groups of
    that size only when the two are equal, else the server judges them after its `--group-timeout` with what arrived.
    """

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None,
                 **kwargs):  # fmt: skip
        if RewardManagerBase is not object:
            super().__init__(config, tokenizer, compute_score)
        self.config, self.tokenizer = config, tokenizer
        self.url = os.environ.get("TRL_LONGRM_REWARD_SERVER", "").rstrip("/")
        if not self.url:
            raise ValueError(
                "Set TRL_LONGRM_REWARD_SERVER to the address of `trl-longrm reward-server` (e.g. http://127.0.0.1:5000) "
                "in the environment of verl's reward workers."
            )
        rollout = config.actor_rollout_ref.rollout
        self.group_size = int(rollout.n)
        validation = int(rollout.get("val_kwargs", {}).get("n", 1) or 1)
        if validation != self.group_size:
            logger.warning(
                "verl validates with %d sample(s) per prompt and trains with %d: the reward server judges validation "
                "groups after its --group-timeout (set actor_rollout_ref.rollout.val_kwargs.n=%d to avoid the wait).",
                validation, self.group_size, self.group_size,
            )  # fmt: skip

    async def run_single(self, data) -> dict:
        import aiohttp  # verl's own dependency (its reward loop posts with it)

        prompt, response, uid = _sample(data, self.tokenizer)
        payload = {"uid": uid, "group_size": self.group_size, "prompt": prompt, "response": response}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            async with session.post(f"{self.url}/verl", json=payload) as answer:
                body = await answer.json(content_type=None)
                if answer.status != 200:
                    raise RuntimeError(f"trl-longrm reward-server at {self.url} answered {answer.status}: {body}")
        return {"reward_score": float(body["score"]),
                "reward_extra_info": {"judge_score": float(body["score"]), "judge_unscored": int(body["unscored"])}}


def compute_score(data_source=None, solution_str=None, ground_truth=None, extra_info=None, **kwargs) -> float:
    """verl's custom reward function (its `naive` manager calls it per sample, with keyword arguments): the pointwise
    judge's score of `solution_str` for the prompt in `extra_info["prompt"]` (messages or text; verl passes the data's
    `extra_info`, so put the prompt there when preparing the data), from the `TRL_LONGRM_JUDGE_*` environment."""
    from trl_longrm.rewards.judge import judge_reward_from_env

    reward = judge_reward_from_env()
    if reward.protocol != "pointwise":
        message = (
            f"verl calls compute_score once per sample: a {reward.protocol} judge has nothing to compare. Set "
            "TRL_LONGRM_JUDGE_PROTOCOL=pointwise, or judge groups with trl_longrm.rewards.verl.JudgeRewardManager and "
            "`trl-longrm reward-server`."
        )
        logger.error(message)
        raise ValueError(message)
    prompt = (extra_info or {}).get("prompt") if hasattr(extra_info, "get") or extra_info is None else None
    if prompt is None:
        raise ValueError("The sample's extra_info has no 'prompt': put the prompt (messages or text) in each row's "
                         "extra_info['prompt'] when preparing verl's data.")  # fmt: skip
    [score] = reward.rewards([_messages(prompt)], [solution_str])
    if score is None:
        raise ValueError("The judge gave no score to this sample (its request was refused); see the warning above.")
    return float(score)
