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

import asyncio
import logging
import os

from trl_longrm.rewards.server.main import API_KEY_ENV  # the reward server's key, sent as a Bearer token


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
        key = os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.patience = float(os.environ.get("TRL_LONGRM_REWARD_PATIENCE", 3600))
        rollout = config.actor_rollout_ref.rollout
        self.group_size = int(rollout.n)
        check_reward_worker_slots(config)
        validation = int(rollout.get("val_kwargs", {}).get("n", 1) or 1)
        if validation != self.group_size:
            logger.warning(
                "verl validates with %d sample(s) per prompt and trains with %d: the reward server judges validation "
                "groups after its --group-timeout (set actor_rollout_ref.rollout.val_kwargs.n=%d to avoid the wait).",
                validation, self.group_size, self.group_size,
            )  # fmt: skip

    async def run_single(self, data) -> dict:
        prompt, response, uid = _sample(data, self.tokenizer)
        payload = {"uid": uid, "group_size": self.group_size, "prompt": prompt, "response": response}
        body = await post_with_retries(f"{self.url}/verl", payload, self.headers, self.patience)
        return {"reward_score": float(body["score"]),
                "reward_extra_info": {"judge_score": float(body["score"]), "judge_unscored": int(body["unscored"])}}


async def post_with_retries(url: str, payload: dict, headers: dict, patience: float) -> dict:
    """POST `payload` to the reward server and return its JSON answer, trying again while the server is unreachable
    (restarting) or answers 503 (judge unavailable, server stopping; after its `Retry-After`), for up to `patience`
    seconds in all. The server holds the request until its group is judged (no read timeout here: that is the
    server's `--judge-timeout`); a 4xx is the request's fault and is raised at once, with the server's message."""
    import aiohttp  # verl's own dependency (its reward loop posts with it)

    deadline = asyncio.get_running_loop().time() + patience
    delay = 1.0
    while True:
        try:
            # A connection per sample, as verl's own reward managers post.
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)) as session:
                async with session.post(url, json=payload, headers=headers) as answer:
                    body = await answer.json(content_type=None)
                    if answer.status == 200:
                        return body
                    if answer.status != 503:
                        raise RuntimeError(f"trl-longrm reward-server at {url} answered {answer.status}: {body}")
                    wait = float(answer.headers.get("Retry-After", delay))
                    reason = f"503: {body.get('error') if isinstance(body, dict) else body}"
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
            wait, reason = delay, f"{type(error).__name__}: {error}"
        now = asyncio.get_running_loop().time()
        if now + wait > deadline:
            raise RuntimeError(f"trl-longrm reward-server at {url} gave no reward within {patience:g} s "
                               f"(TRL_LONGRM_REWARD_PATIENCE); last: {reason}")  # fmt: skip
        logger.warning("Reward server at %s: %s; trying again in %.0f s.", url, reason, wait)
        await asyncio.sleep(wait)
        delay = min(delay * 2, 30.0)


# Ray runs an async actor's calls at most 1,000 at a time (its default `max_concurrency`), and verl creates its reward
# workers without raising it (verl/experimental/reward_loop/reward_loop.py, `RewardLoopManager`).
RAY_ASYNC_ACTOR_CONCURRENCY = 1000


def check_reward_worker_slots(config) -> None:
    """Refuse a verl run whose reward workers could deadlock on a step's samples.

    verl's agent loop sends each finished sample to one of `reward.num_workers` reward workers at random; each worker
    runs at most 1,000 calls at a time (Ray's default for an async actor) and queues the rest. Our manager's call is
    held until the sample's whole group is judged. With S samples in flight, W slots and groups of G, at most S - W
    samples wait in the queues, so at most S - W held groups lack a member, holding at most (S - W)(G - 1) slots:
    while that is under W, some group is always whole and the step moves on, whatever the order samples finish in.
    Past it, held samples can fill every slot while their groups' members wait behind them (judged only after
    `--group-timeout`, without those members). The error names the `reward.num_workers` that rules it out."""
    try:
        prompts = int(config.data.get("gen_batch_size") or config.data.train_batch_size)
        group = int(config.actor_rollout_ref.rollout.n)
        workers = int(config.reward.num_workers)
    except (AttributeError, KeyError, TypeError, ValueError):
        return  # a config without these keys (another verl layout): nothing to check against
    samples, slots = prompts * group, workers * RAY_ASYNC_ACTOR_CONCURRENCY
    if group > 1 and (samples - slots) * (group - 1) >= slots:
        # The fewest workers W with (S - W)(G - 1) < W, i.e. W > S (G - 1) / G.
        needed = samples * (group - 1) // (group * RAY_ASYNC_ACTOR_CONCURRENCY) + 1
        message = (
            f"verl's reward workers hold {slots} samples at once (reward.num_workers={workers} x Ray's "
            f"{RAY_ASYNC_ACTOR_CONCURRENCY} calls per async actor), too few for a step's {samples} samples in groups "
            f"of {group} (data.train_batch_size x actor_rollout_ref.rollout.n): held samples could fill every slot "
            f"while their groups' members wait behind them. Set reward.num_workers={needed} (or more)."
        )
        logger.error(message)
        raise ValueError(message)


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
