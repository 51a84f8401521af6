"""A generative judge (GRM) as a reward function for TRL's online trainers (GRPO, RLOO): each prompt's completions
judged together, in the format the judge was trained on, on any engine (a server, vLLM in process, transformers)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trl_longrm.evaluation.benchmark import task_text
from trl_longrm.evaluation.judges import GenerativeJudge, JudgeRequest, load_tokenizer
from trl_longrm.evaluation.prompts import parse_pairwise_verdict, parse_ranking_verdict
from trl_longrm.evaluation.templates import PromptTemplate
from trl_longrm.serving.base import GenerationEngine
from trl_longrm.serving.transformers_engine import TransformersGenerator


logger = logging.getLogger(__name__)

PROTOCOLS = ("pairwise", "ranking", "pointwise")
# When a row has no reward: TRL's GRPO/RLOO take None as "unscorable" (NaN, left out of the group's baseline, advantage
# 0). A made-up value (a tie, the scale's middle) would move the row's advantage on nothing the judge said.
UNSCORED_RULE = {
    "pairwise": "a comparison without a readable verdict is left out of the win rate; a completion with none left is unscored",
    "ranking": "an unreadable ranking leaves its group unscored",
    "pointwise": "a judgment without a score (and, with verdict_probs, without score probabilities) is unscored",
}


@dataclass
class PreparedBatch:
    """A batch's judge requests rendered and not yet sent (`JudgeReward.prepare`): `rows` completions, `requests`
    and what each compares (`plan`), their prompts as token ids (`rendered`, None without requests)."""

    rows: int
    requests: list[JudgeRequest]
    plan: list[list[int]]
    rendered: object


@dataclass
class JudgedBatch:
    """One batch's rewards and what the judge said: `rewards` one per completion, in the batch's order, None where
    the judge said nothing to score it by; `requests` and `outputs` the judge's requests and answers (of this process's
    share of the groups, under several processes); `unparsed` how many verdicts (comparisons, rankings or judgments)
    could not be read, `verdicts` how many were asked for, `refused` how many requests the server refused, `unscored`
    how many rows have no reward (all of them summed over the processes)."""

    rewards: list[float | None]
    requests: list[JudgeRequest]
    outputs: list
    unparsed: int
    verdicts: int
    refused: int = 0
    unscored: int = 0


def _refuse_settings_of_a_judge(judge: GenerativeJudge, **given) -> None:
    """A `GenerativeJudge` comes with its own engine, tokenizer, template, lengths and verdict reading: a setting given
    beside it that differs from the judge's own cannot be honoured, and is refused by name (never silently ignored)."""
    own = {"tokenizer": judge.tokenizer, "template": judge.template, "max_length": judge.max_length,
           "max_new_tokens": judge.max_new_tokens, "verdict_probs": judge.verdict_probs}  # fmt: skip
    conflicts = []
    for key, value in given.items():
        if value is None:
            continue
        if key in own and (value is own[key] or (not isinstance(value, (str, PromptTemplate)) and value == own[key])):
            continue  # the judge's own value, given again
        conflicts.append(f"{key}={value!r}" if isinstance(value, (int, float, bool, str)) else key)
    if conflicts:
        raise TypeError(
            f"JudgeReward was given a GenerativeJudge, which judges with its own settings; {', '.join(conflicts)} "
            "cannot apply to it. Set them on the GenerativeJudge, or give JudgeReward the engine (or server URL) "
            "instead of the judge."
        )


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
      completion's reward is its win rate over its comparisons with a readable verdict, in [0, 1].
    - `ranking`: one request listing the group in batch order; the completion ranked r-th (0 = best) gets
      (G-1-r)/(G-1).
    - `pointwise`: each completion judged alone; its reward is its score on the template's scale (0..9 by default):
      with `verdict_probs` (default) the expected score under the judge's score-token probabilities (a forced pass
      reads them where the judgment has no verdict), else the parsed score.

    **Unscored rows.** A row the judge gave nothing to score it by gets `None`, which TRL's GRPO/RLOO take as
    unscorable (left out of the group's mean and std, advantage 0): a completion none of whose comparisons has a
    readable verdict, a group whose ranking is unreadable, a pointwise judgment without a score, a group of one
    completion under `pairwise` / `ranking` (nothing to compare), and the rows of a request the server refused (a 4xx:
    the rest of the step is kept). Each call logs, through the `log_metric` GRPO passes, `judge/unparsed_verdicts`,
    `judge/unparsed_fraction`, `judge/refused_requests` and `judge/unscored_rows`, and warns through this module's
    logger when any is non-zero. A server that is down or too slow still fails the step with one `EngineError`.

    **Several processes.** GRPO/RLOO spread a group's completions over the processes of a distributed run and call
    the reward function on each process's rows. Every call gathers the rows of all processes (`torch.distributed`, on
    a gloo group of its own), deals the whole groups out among the processes (each judged once, by one process), and
    returns each process its own rows' rewards: the rewards and logged counters are those of one process judging the
    whole batch, whatever `per_device_train_batch_size` and `num_generations`. `across_processes=False` judges each
    call's rows alone (for callers whose processes do not all call it together).

    **Bounded work.** A transformers judge generates `batch_size` prompts at a time (a 128K-token pairwise group of 8
    is 56 prompts); a server gets at most `max_concurrency` requests in flight from each process. The judge's context
    is `max_length`, cut down to the engine's own (`max_model_len` of a vLLM server's `/v1/models`, or of vLLM in
    process) when that is smaller, so that no request is longer than the server takes.

    Every request of a group starts with the same tokens (the judge's system prompt, then the task), and the long
    context comes first, so that an engine with a prefix cache (a vLLM server with `--enable-prefix-caching`, vLLM in
    process) prefills it once per group, not once per request: vLLM shares it even among the group's requests sent
    together (`bench/judge_reward.py`). For a server that does not, `warm_prefix=True` first sends each group's
    common token prefix alone (one token generated), then the group's requests (one round trip more per call).

    The task the judge reads is made as the evaluation makes it (`trl_longrm.evaluation.benchmark.task_text`: the
    prompt messages' contents joined by a blank line; a plain-text prompt as it is); a conversational completion is
    read as its assistant messages' contents.

    `judge` is a `GenerativeJudge` (used as it is: its prompts, cut and engine; a request the server refuses then
    leaves its rows unscored too), a `GenerationEngine` (`OpenAIGenerator`, `VLLMGenerator`), a transformers causal
    LM, or the URL of an OpenAI-compatible server (`model` names the served model; `max_concurrency`, `timeout`,
    `max_retries`, `api_key` go to `OpenAIGenerator`, which also sends the checkpoint's repetition penalty and refuses
    a served checkpoint whose tokenizer is not `tokenizer`). `tokenizer` is the judge checkpoint's tokenizer (or its
    path).

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
        max_length: int | None = None,
        max_new_tokens: int | None = None,
        verdict_probs: bool | None = None,
        warm_prefix: bool = False,
        batch_size: int | None = None,
        across_processes: bool = True,
        name: str = "JudgeReward",
        **engine_kwargs: Any,
    ):
        from trl_longrm.rewards.distributed import ProcessGroupExchange

        if protocol not in PROTOCOLS:
            raise ValueError(f"`protocol` must be one of {list(PROTOCOLS)}, got {protocol!r}.")
        self.protocol = protocol
        if isinstance(judge, GenerativeJudge):
            if (judge.protocol == "pointwise") != (protocol == "pointwise"):
                raise ValueError(f"The judge's protocol is {judge.protocol!r}; JudgeReward's is {protocol!r}.")
            _refuse_settings_of_a_judge(judge, tokenizer=tokenizer, model=model, template=template,
                                        max_length=max_length, max_new_tokens=max_new_tokens,
                                        verdict_probs=verdict_probs, batch_size=batch_size, **engine_kwargs)  # fmt: skip
            # A copy: a refused request leaves its rows unscored and the step goes on, while the caller's judge keeps
            # its own rule (the judges are re-entrant, so the copy shares the engine safely).
            self.judge = copy.copy(judge)
            self.judge.refusals = "keep"
        else:
            max_length = 131072 if max_length is None else max_length
            max_new_tokens = 2048 if max_new_tokens is None else max_new_tokens
            verdict_probs = True if verdict_probs is None else verdict_probs
            if isinstance(tokenizer, str) or (tokenizer is None and isinstance(judge, str) and model):
                tokenizer = load_tokenizer(tokenizer or model)
            if tokenizer is None:
                raise ValueError("JudgeReward needs the judge checkpoint's tokenizer (or its path) to build prompts.")
            if isinstance(judge, str):
                from trl_longrm.serving.base import greedy_settings
                from trl_longrm.serving.openai_engine import OpenAIGenerator

                greedy = greedy_settings(getattr(tokenizer, "name_or_path", None), "openai")
                judge = OpenAIGenerator(judge, model, tokenizer=tokenizer, **greedy, **engine_kwargs)
            elif engine_kwargs:
                raise TypeError(f"{sorted(engine_kwargs)} apply to a server URL only.")
            elif not isinstance(judge, GenerationEngine):
                judge = TransformersGenerator(judge, tokenizer, batch_size=8 if batch_size is None else batch_size)
            if batch_size is not None and not isinstance(judge, TransformersGenerator):
                raise TypeError(
                    f"`batch_size` applies to a transformers judge (prompts per `generate` call); {type(judge).__name__} "
                    "batches by itself (a server: `max_concurrency` requests in flight)."
                )
            if isinstance(template, str):
                template = PromptTemplate.from_yaml(template)
            engine_length = getattr(judge, "max_model_len", None)
            if engine_length is not None and engine_length < max_length:
                logger.warning(
                    "%s: the judge engine takes %d tokens (its max_model_len), fewer than max_length=%d: requests are "
                    "cut to %d tokens (prompt + judgment).", name, engine_length, max_length, engine_length,
                )  # fmt: skip
                max_length = engine_length
            # Pairwise and ranking read parsed verdicts only: their probabilities would cost a forced pass for nothing.
            self.judge = GenerativeJudge(
                judge,
                tokenizer,
                max_length=max_length,
                max_new_tokens=max_new_tokens,
                verdict_probs=verdict_probs and protocol == "pointwise",
                protocol="pointwise" if protocol == "pointwise" else "pairwise",
                template=template,
                refusals="keep",
            )
        # Only an engine with a prefix cache gains from prefilling the shared context first.
        self.warm_prefix = warm_prefix and not isinstance(self.judge.engine, TransformersGenerator)
        # Off where the processes of a torch.distributed group do not all call the reward together (a framework's
        # per-sample reward workers): there each call judges its own rows.
        self.exchange = ProcessGroupExchange() if across_processes else None
        self.__name__ = name  # TRL logs each reward function under its `__name__`

    # -- requests -----------------------------------------------------------------------------------------------------

    def _requests(self, prompts: Sequence, completions: Sequence) -> tuple[list[JudgeRequest], list, list[list[int]]]:
        """The judge's requests, and for each request what it compares (pairwise: the two rows shown as A and B;
        ranking: the group's rows in display order; pointwise: the group's rows, one judgment each), groups' requests
        consecutive."""
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

    def _request_count(self, size: int) -> int:
        """How many requests (pairwise) or judgments (pointwise, ranking: one) a group of `size` costs."""
        if self.protocol == "pairwise":
            return size * (size - 1)
        return size if self.protocol == "pointwise" else int(size > 1)

    def _group_prompt_ids(self, requests: list[JudgeRequest]) -> list[list[int]]:
        """The judge's prompt token ids of each request (as `GenerativeJudge.judge` renders and cuts them)."""
        return self.judge.render(requests).prompts

    def _warm(self, requests: list[JudgeRequest], rendered) -> None:
        """Prefill each group's shared context once: its requests' common token prefix (of their `rendered`
        prompts), one token generated."""
        from trl_longrm.evaluation.judges import _common_prefix_length

        by_group: dict[str, list[list[int]]] = {}
        for ids, owner in zip(rendered.prompts, rendered.owners):
            by_group.setdefault(requests[owner].record_id.split("/")[0], []).append(ids)
        prefixes = []
        for ids in by_group.values():
            if len(ids) > 1:
                shared = _common_prefix_length(ids)
                if shared:
                    prefixes.append(ids[0][:shared])
        if prefixes:
            self.judge.engine.generate(prefixes, 1)

    # -- rewards ------------------------------------------------------------------------------------------------------

    def prepare(self, prompts: Sequence, completions: Sequence) -> PreparedBatch:
        """A batch's judge requests, rendered to token ids, not yet sent (`judge_batch`'s first half: CPU only)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
        requests, plan, _ = self._requests(prompts, completions)
        rendered = self.judge.render(requests) if requests else None
        return PreparedBatch(len(prompts), requests, plan, rendered)

    def judge_batch(self, prompts: Sequence, completions: Sequence, prepared: PreparedBatch | None = None) -> JudgedBatch:
        """The rewards of a batch judged here, on this process alone, and the judge's answers (blocking); `prepared`
        is `prepare(prompts, completions)` when the caller made it already."""
        prepared = prepared if prepared is not None else self.prepare(prompts, completions)
        requests, plan = prepared.requests, prepared.plan
        if self.warm_prefix and requests:
            self._warm(requests, prepared.rendered)
        outputs = self.judge.judge(requests, prepared.rendered) if requests else []
        rows = prepared.rows
        rewards: list[float | None] = [None] * rows
        unparsed = verdicts = refused = 0
        if self.protocol == "pairwise":
            wins = [0.0] * rows
            comparisons = [0] * rows
            for (a, b), output in zip(plan, outputs):
                verdicts += 1
                if output.refusal:
                    refused += 1
                    continue
                ranks = parse_pairwise_verdict(output.text)
                if ranks is None:
                    unparsed += 1
                    continue
                for row, rank in zip((a, b), ranks):
                    wins[row] += float(rank == 0)
                    comparisons[row] += 1
            for row, n in enumerate(comparisons):
                if n:
                    rewards[row] = wins[row] / n
        elif self.protocol == "ranking":
            for rows, output in zip(plan, outputs):
                verdicts += 1
                if output.refusal:
                    refused += 1
                    continue
                ranks = parse_ranking_verdict(output.text, len(rows))
                if ranks is None:
                    unparsed += 1
                    continue
                for row, rank in zip(rows, ranks):
                    rewards[row] = (len(rows) - 1 - rank) / (len(rows) - 1)
        else:
            score_format = self.judge.template.pointwise_format
            for rows, output in zip(plan, outputs):
                for k, (row, judgment) in enumerate(zip(rows, output.judgments)):
                    verdicts += 1
                    if judgment is None:  # its prompt was refused
                        refused += 1
                        continue
                    parsed = score_format.parse(judgment)
                    unparsed += parsed is None
                    expected = output.scores[k] if output.scores is not None else None
                    if expected is not None:
                        rewards[row] = float(expected)
                    elif parsed is not None:
                        rewards[row] = float(parsed)
        unscored = sum(reward is None for reward in rewards)
        return JudgedBatch(rewards, requests, outputs, unparsed, verdicts, refused, unscored)

    def judge_all_processes(self, prompts: Sequence, completions: Sequence) -> JudgedBatch:
        """This process's rewards with every group judged whole: under several processes, the rows of all of them
        gathered, the groups dealt out (each judged once), the rewards returned to their rows' processes; the counters
        are the whole batch's. With one process, `judge_batch` (blocking)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
        if self.exchange is None or self.exchange.world_size == 1:
            return self.judge_batch(prompts, completions)
        from trl_longrm.rewards.distributed import judge_whole_groups

        def judge(rows):
            batch = self.judge_batch([p for p, _ in rows], [c for _, c in rows])
            counters = {"unparsed": batch.unparsed, "verdicts": batch.verdicts, "refused": batch.refused}
            return batch.rewards, counters, batch

        def cost(rows, group):  # requests x their length: what a group costs the judge
            size = sum(len(completion_text(rows[i][1])) for i in group) + len(repr(rows[group[0]][0]))
            return self._request_count(len(group)) * size

        rewards, totals, own = judge_whole_groups(
            self.exchange, list(zip(prompts, completions)), lambda rows: group_by_prompt([p for p, _ in rows]), cost,
            judge,
        )  # fmt: skip
        return JudgedBatch(
            rewards,
            own.requests if own else [],
            own.outputs if own else [],
            totals.get("unparsed", 0),
            totals.get("verdicts", 0),
            totals.get("refused", 0),
            # Each process counts its own rows: the sum over the processes is the batch's, as one process counts it.
            sum(int(count) for count in self.exchange.all_gather(sum(r is None for r in rewards))),
        )

    def rewards(self, prompts: Sequence, completions: Sequence, log_metric=None) -> list[float | None]:
        """One reward per completion, in order, None where unscored (blocking): what `__call__` returns, for callers
        without an event loop."""
        if not prompts and (self.exchange is None or self.exchange.world_size == 1):
            return []
        batch = self.judge_all_processes(prompts, completions)
        self._report(batch, log_metric)
        return batch.rewards

    def _report(self, batch: JudgedBatch, log_metric) -> None:
        if batch.unparsed or batch.refused or batch.unscored:
            logger.warning(
                "%s: %d of %d judge verdicts could not be read, %d requests were refused, %d rows are unscored "
                "(None: %s).",
                self.__name__,
                batch.unparsed,
                batch.verdicts,
                batch.refused,
                batch.unscored,
                UNSCORED_RULE[self.protocol],
            )
        if log_metric is not None:
            log_metric("judge/unparsed_verdicts", float(batch.unparsed))
            log_metric("judge/unparsed_fraction", batch.unparsed / batch.verdicts if batch.verdicts else 0.0)
            log_metric("judge/refused_requests", float(batch.refused))
            log_metric("judge/unscored_rows", float(batch.unscored))

    async def __call__(self, prompts: list, completions: list, log_metric=None, **kwargs) -> list[float | None]:
        """One reward per completion, in order, None where unscored (TRL's reward-function signature); the engine
        calls (and, under several processes, the exchange of rows) run in a worker thread so that GRPO's event loop
        (and the other async reward functions on it) keep running."""
        if not prompts and (self.exchange is None or self.exchange.world_size == 1):
            return []
        batch = await asyncio.to_thread(self.judge_all_processes, prompts, completions)
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
            # Called by a framework's reward workers one at a time, never by every process of a group together.
            across_processes=False,
        )
    return _FROM_ENV[values]


__all__ = ["ENVIRONMENT", "judge_reward_from_env", "JudgeReward", "JudgedBatch", "completion_text", "group_by_prompt", "prompt_messages"]
