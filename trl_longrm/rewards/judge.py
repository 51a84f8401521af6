"""A generative judge (GRM) as a reward function for TRL's online trainers (GRPO, RLOO): each prompt's completions
judged together, in the format the judge was trained on, on any engine (a server, vLLM in process, transformers)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trl_longrm.evaluation.benchmark import task_text
from trl_longrm.evaluation.judges import GenerativeJudge, JudgeRequest, load_tokenizer
from trl_longrm.evaluation.prompts import parse_pairwise_verdict, parse_ranking_verdict
from trl_longrm.evaluation.templates import PromptTemplate
from trl_longrm.serving.transformers_engine import TransformersGenerator


logger = logging.getLogger(__name__)

PROTOCOLS = ("pairwise", "ranking", "pointwise")
# What a comparison, a ranking or a score the judge left unparsable is worth: a tie (pairwise: half a win), the middle
# rank (ranking) or the middle of the score scale (pointwise), so that it moves no completion's advantage either way.
TIE = 0.5
UNPARSED_RULE = {
    "pairwise": "each counted as a tie: half a win to each side",
    "ranking": "each group's completions given 0.5",
    "pointwise": "given the expected score with verdict_probs, else the scale's middle",
}


@dataclass
class JudgedBatch:
    """One batch's rewards and what the judge said: `rewards` one per completion, in the batch's order; `requests`
    and `outputs` the judge's requests and answers; `unparsed` how many verdicts (comparisons, rankings or
    judgments) could not be read; `verdicts` how many were asked for."""

    rewards: list[float]
    requests: list[JudgeRequest]
    outputs: list
    unparsed: int
    verdicts: int


def prompt_messages(prompt) -> list[dict[str, str]]:
    """A TRL prompt as messages: a conversation as it is, a plain-text prompt as one user message."""
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def completion_text(completion) -> str:
    """The response the judge reads: a plain-text completion as it is; a conversational one (a list of messages, tool
    calls and tool answers included) as its assistant messages' contents joined by a blank line."""
    if isinstance(completion, str):
        return completion
    return "\n\n".join(m["content"] for m in completion if m.get("role") == "assistant" and m.get("content"))


def group_by_prompt(prompts: Sequence) -> list[list[int]]:
    """The batch's row indices grouped by equal prompt, groups in order of first appearance (GRPO lays each prompt's
    generations consecutively; equal prompts elsewhere in the batch join the same group)."""
    groups: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(repr(prompt), []).append(index)
    return list(groups.values())


class JudgeReward:
    """A generative judge as a `reward_funcs` entry of TRL's `GRPOTrainer` / `RLOOTrainer` (an async callable, run
    on GRPO's event loop; the blocking engine calls go to a worker thread).

    The completions of one prompt (a group) are judged together, in the format the judge was trained on:

    - `pairwise`: every pair of the group, in both display orders (A/B then B/A, to cancel position bias); a
      completion's reward is its win rate over its 2(G-1) comparisons, in [0, 1]. An unparsable verdict counts as a
      tie (half a win to each side).
    - `ranking`: one request listing the group in batch order; the completion ranked r-th (0 = best) gets
      (G-1-r)/(G-1). An unparsable ranking gives every completion of the group 0.5.
    - `pointwise`: each completion judged alone; its reward is its score on the template's scale (0..9 by default):
      with `verdict_probs` (default) the expected score under the judge's score-token probabilities (a forced pass
      reads them where the judgment has no verdict), else the parsed score, and the scale's middle where the judgment
      has none.

    A group of one completion has nothing to be compared with under `pairwise` and `ranking`: it gets 0.5, with no
    request. Each call logs, through the `log_metric` GRPO passes, `judge/unparsed_verdicts` (the number of verdicts
    that could not be read) and `judge/unparsed_fraction`, and warns through this module's logger when there are any.

    Every request of a group starts with the same tokens (the judge's system prompt, then the task), and the long
    context comes first, so that an engine with a prefix cache (a vLLM server with `--enable-prefix-caching`, vLLM in
    process) prefills it once per group, not once per request: vLLM shares it even among the group's requests sent
    together (`bench/judge_reward.py`). For a server that does not, `warm_prefix=True` first sends each group's
    common token prefix alone (one token generated), then the group's requests (one round trip more per call).

    The task the judge reads is made as the evaluation makes it (`trl_longrm.evaluation.benchmark.task_text`: the
    prompt messages' contents joined by a blank line; a plain-text prompt as it is); a conversational completion is
    read as its assistant messages' contents.

    `judge` is a `GenerativeJudge` (used as it is: its prompts, cut and engine), a `GenerationEngine`
    (`OpenAIGenerator`, `VLLMGenerator`), a transformers causal LM, or the URL of an OpenAI-compatible server
    (`model` names the served model; `max_concurrency`, `timeout`, `max_retries`, `api_key` go to `OpenAIGenerator`).
    `tokenizer` is the judge checkpoint's tokenizer (or its path). A server down or too slow raises one `EngineError`.

    Example:
    ```python
    >>> from trl import GRPOConfig, GRPOTrainer
    >>> from trl_longrm import JudgeReward
    >>> reward = JudgeReward("http://127.0.0.1:8000/v1", "./LongReward_Qwen3-8B", model="judge", protocol="pairwise")
    >>> trainer = GRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward, args=GRPOConfig(output_dir="grpo"),
    ...                       train_dataset=prompts)
    ```
    """

    def __init__(
        self,
        judge,
        tokenizer=None,
        *,
        protocol: str = "pairwise",
        model: str | None = None,
        template: PromptTemplate | str | None = None,
        max_length: int = 131072,
        max_new_tokens: int = 2048,
        verdict_probs: bool = True,
        warm_prefix: bool = False,
        name: str = "JudgeReward",
        **engine_kwargs: Any,
    ):
        if protocol not in PROTOCOLS:
            raise ValueError(f"`protocol` must be one of {list(PROTOCOLS)}, got {protocol!r}.")
        self.protocol = protocol
        if isinstance(judge, GenerativeJudge):
            if (judge.protocol == "pointwise") != (protocol == "pointwise"):
                raise ValueError(f"The judge's protocol is {judge.protocol!r}; JudgeReward's is {protocol!r}.")
            self.judge = judge
        else:
            if isinstance(tokenizer, str) or (tokenizer is None and isinstance(judge, str) and model):
                tokenizer = load_tokenizer(tokenizer or model)
            if tokenizer is None:
                raise ValueError("JudgeReward needs the judge checkpoint's tokenizer (or its path) to build prompts.")
            if isinstance(judge, str):
                from trl_longrm.serving.openai_engine import OpenAIGenerator

                judge = OpenAIGenerator(judge, model, tokenizer=tokenizer, **engine_kwargs)
            elif engine_kwargs:
                raise TypeError(f"{sorted(engine_kwargs)} apply to a server URL only.")
            if isinstance(template, str):
                template = PromptTemplate.from_yaml(template)
            # Pairwise and ranking read parsed verdicts only: their probabilities would cost a forced pass for nothing.
            self.judge = GenerativeJudge(
                judge,
                tokenizer,
                max_length=max_length,
                max_new_tokens=max_new_tokens,
                verdict_probs=verdict_probs and protocol == "pointwise",
                protocol="pointwise" if protocol == "pointwise" else "pairwise",
                template=template,
            )
        # Only an engine with a prefix cache gains from prefilling the shared context first.
        self.warm_prefix = warm_prefix and not isinstance(self.judge.engine, TransformersGenerator)
        self.__name__ = name  # TRL logs each reward function under its `__name__`

    # -- requests -----------------------------------------------------------------------------------------------------

    def _requests(self, prompts: Sequence, completions: Sequence) -> tuple[list[JudgeRequest], list, list[list[int]]]:
        """The judge's requests, and for each request what it compares (pairwise: the two rows shown as A and B;
        ranking: the group's rows in display order; pointwise: the row), groups' requests consecutive."""
        requests, plan = [], []
        groups = group_by_prompt(prompts)
        for g, rows in enumerate(groups):
            messages = prompt_messages(prompts[rows[0]])
            task = task_text(messages)
            texts = {row: completion_text(completions[row]) for row in rows}
            if self.protocol == "pointwise":
                # One request per group: the judge writes one judgment per response.
                requests.append(JudgeRequest(f"group{g}", messages, task, [texts[r] for r in rows], ranking=False))
                plan.append(list(rows))
            elif len(rows) < 2:
                continue
            elif self.protocol == "ranking":
                requests.append(JudgeRequest(f"group{g}", messages, task, [texts[r] for r in rows], ranking=True))
                plan.append(list(rows))
            else:
                for i, first in enumerate(rows):
                    for second in rows[i + 1 :]:
                        for a, b in ((first, second), (second, first)):
                            requests.append(
                                JudgeRequest(f"group{g}/{a}-{b}", messages, task, [texts[a], texts[b]], ranking=False)
                            )
                            plan.append([a, b])
        return requests, plan, groups

    def _group_prompt_ids(self, requests: list[JudgeRequest]) -> list[list[int]]:
        """The judge's prompt token ids of each request (as `GenerativeJudge.judge` renders and cuts them)."""
        template = self.judge.template
        ids = []
        for request in requests:
            if self.protocol == "pointwise":
                for response in request.responses:
                    ids.append(self.judge._prompt_ids(template.pointwise_messages(request.task_prompt, response))[0])
            elif request.ranking:
                ids.append(self.judge._prompt_ids(template.ranking_messages(request.task_prompt, request.responses))[0])
            else:
                ids.append(self.judge._prompt_ids(template.pairwise_messages(request.task_prompt, request.responses))[0])
        return ids

    def _warm(self, requests: list[JudgeRequest]) -> None:
        """Prefill each group's shared context once: its requests' common token prefix, one token generated."""
        from trl_longrm.evaluation.judges import _common_prefix_length

        by_group: dict[str, list[JudgeRequest]] = {}
        for request in requests:
            by_group.setdefault(request.record_id.split("/")[0], []).append(request)
        prefixes = []
        for group in by_group.values():
            ids = self._group_prompt_ids(group)
            if len(ids) > 1:
                shared = _common_prefix_length(ids)
                if shared:
                    prefixes.append(ids[0][:shared])
        if prefixes:
            self.judge.engine.generate(prefixes, 1)

    # -- rewards ------------------------------------------------------------------------------------------------------

    def judge_batch(self, prompts: Sequence, completions: Sequence) -> JudgedBatch:
        """The rewards of a batch and the judge's answers (blocking; `__call__` runs it in a worker thread)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
        requests, plan, groups = self._requests(prompts, completions)
        if self.warm_prefix and requests:
            self._warm(requests)
        outputs = self.judge.judge(requests) if requests else []
        rewards = [TIE] * len(prompts)
        unparsed = verdicts = 0
        if self.protocol == "pairwise":
            wins = [0.0] * len(prompts)
            comparisons = [0] * len(prompts)
            for (a, b), output in zip(plan, outputs):
                ranks = parse_pairwise_verdict(output.text)
                verdicts += 1
                if ranks is None:
                    unparsed += 1
                    won = (TIE, TIE)
                else:
                    won = (float(ranks[0] == 0), float(ranks[1] == 0))
                for row, w in zip((a, b), won):
                    wins[row] += w
                    comparisons[row] += 1
            for row, n in enumerate(comparisons):
                if n:
                    rewards[row] = wins[row] / n
        elif self.protocol == "ranking":
            for rows, output in zip(plan, outputs):
                verdicts += 1
                ranks = parse_ranking_verdict(output.text, len(rows))
                if ranks is None:
                    unparsed += 1
                    continue
                for row, rank in zip(rows, ranks):
                    rewards[row] = (len(rows) - 1 - rank) / (len(rows) - 1)
        else:
            score_format = self.judge.template.pointwise_format
            low, high = score_format.scale
            for rows, output in zip(plan, outputs):
                for k, (row, judgment) in enumerate(zip(rows, output.judgments)):
                    verdicts += 1
                    parsed = score_format.parse(judgment)
                    unparsed += parsed is None
                    if output.scores is not None:
                        rewards[row] = float(output.scores[k])
                    else:
                        rewards[row] = float(parsed) if parsed is not None else (low + high) / 2
        return JudgedBatch(rewards, requests, outputs, unparsed, verdicts)

    def rewards(self, prompts: Sequence, completions: Sequence, log_metric=None) -> list[float]:
        """One reward per completion, in order (blocking): what `__call__` returns, for callers without an event
        loop (verl, OpenRLHF)."""
        if not prompts:
            return []
        batch = self.judge_batch(prompts, completions)
        self._report(batch, log_metric)
        return batch.rewards

    def _report(self, batch: JudgedBatch, log_metric) -> None:
        if batch.unparsed:
            logger.warning(
                "%s: %d of %d judge verdicts could not be read (%s).",
                self.__name__,
                batch.unparsed,
                batch.verdicts,
                UNPARSED_RULE[self.protocol],
            )
        if log_metric is not None:
            log_metric("judge/unparsed_verdicts", float(batch.unparsed))
            log_metric("judge/unparsed_fraction", batch.unparsed / batch.verdicts if batch.verdicts else 0.0)

    async def __call__(self, prompts: list, completions: list, log_metric=None, **kwargs) -> list[float]:
        """One reward per completion, in order (TRL's reward-function signature); the engine calls run in a worker
        thread so that GRPO's event loop (and the other async reward functions on it) keep running."""
        if not prompts:
            return []
        batch = await asyncio.to_thread(self.judge_batch, prompts, completions)
        self._report(batch, log_metric)
        return batch.rewards


# The settings of the file-based entry points (verl's `compute_score`, OpenRLHF's `reward_func`), which are called
# with the batch only: the judge's server and protocol come from the environment of the process that calls them.
ENVIRONMENT = {
    "TRL_LONGRM_JUDGE_URL": "the judge server's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (required)",
    "TRL_LONGRM_JUDGE_MODEL": "the served model's name (default: the only one the server serves)",
    "TRL_LONGRM_JUDGE_TOKENIZER": "the judge checkpoint's path or hub id, for its tokenizer (default: the model name)",
    "TRL_LONGRM_JUDGE_PROTOCOL": "pairwise (default), ranking or pointwise",
    "TRL_LONGRM_JUDGE_TEMPLATE": "a prompt template YAML file (default: the built-in prompts)",
    "TRL_LONGRM_JUDGE_MAX_LENGTH": "the judge's context in tokens (default 131072)",
    "TRL_LONGRM_JUDGE_MAX_NEW_TOKENS": "the longest judgment in tokens (default 2048)",
    "TRL_LONGRM_JUDGE_VERDICT_PROBS": "pointwise: 1 (default) rewards the expected score, 0 the parsed one",
    "TRL_LONGRM_JUDGE_MAX_CONCURRENCY": "requests in flight (default 8)",
    "TRL_LONGRM_JUDGE_TIMEOUT": "seconds per request before an EngineError (default 600)",
}
_FROM_ENV: dict[tuple, JudgeReward] = {}


def judge_reward_from_env(environ=None) -> JudgeReward:
    """The `JudgeReward` the `TRL_LONGRM_JUDGE_*` environment variables describe (`ENVIRONMENT`), built once per
    process and setting (the tokenizer load and the server's model check are not repeated at every step).
    `OPENAI_API_KEY`, when set, is sent to the server."""
    import os

    environ = os.environ if environ is None else environ
    values = tuple(environ.get(key) for key in ENVIRONMENT)
    if values not in _FROM_ENV:
        get = dict(zip(ENVIRONMENT, values)).get
        url = get("TRL_LONGRM_JUDGE_URL")
        if not url:
            raise ValueError(
                "Set TRL_LONGRM_JUDGE_URL to the judge server's base URL (e.g. http://127.0.0.1:8000/v1) in the "
                "environment of the process computing rewards."
            )
        model = get("TRL_LONGRM_JUDGE_MODEL")
        tokenizer = get("TRL_LONGRM_JUDGE_TOKENIZER") or model
        if not tokenizer:
            raise ValueError("Set TRL_LONGRM_JUDGE_TOKENIZER (the judge checkpoint's path) or TRL_LONGRM_JUDGE_MODEL.")
        _FROM_ENV[values] = JudgeReward(
            url,
            tokenizer,
            model=model,
            protocol=get("TRL_LONGRM_JUDGE_PROTOCOL") or "pairwise",
            template=get("TRL_LONGRM_JUDGE_TEMPLATE") or None,
            max_length=int(get("TRL_LONGRM_JUDGE_MAX_LENGTH") or 131072),
            max_new_tokens=int(get("TRL_LONGRM_JUDGE_MAX_NEW_TOKENS") or 2048),
            verdict_probs=(get("TRL_LONGRM_JUDGE_VERDICT_PROBS") or "1") not in ("0", "false", "False"),
            max_concurrency=int(get("TRL_LONGRM_JUDGE_MAX_CONCURRENCY") or 8),
            timeout=float(get("TRL_LONGRM_JUDGE_TIMEOUT") or 600),
        )
    return _FROM_ENV[values]


__all__ = ["ENVIRONMENT", "judge_reward_from_env", "JudgeReward", "JudgedBatch", "completion_text", "group_by_prompt", "prompt_messages"]
