"""A group judged off the event loop, under one server-wide budget of requests in flight to the judge.

`JudgeReward.judge_batch` is blocking (it renders and tokenizes the prompts, then sends them through the engine's
pool): it runs in a worker thread. A group starts judging only when its requests fit in the budget
(`--max-concurrency`, shared by all groups; a group larger than the whole budget runs alone), in arrival order, so
that the judge server sees at most that many requests whatever the number of clients, and a group's judging time is
its own, not a queue's: the `--judge-timeout` counted from its start is then a bound on a hung judge, not on load.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import ThreadPoolExecutor

from trl_longrm.rewards.server.groups import Judged
from trl_longrm.serving.base import EngineUnavailable


logger = logging.getLogger("trl_longrm.reward_server")


class JudgeUnavailable(Exception):
    """The judge server cannot be reached, answers server errors, or did not judge a group in time: the request may
    succeed later (answered 503 with `Retry-After`)."""


class RequestBudget:
    """At most `capacity` judge requests in flight over all groups, granted first come first served; a group that
    needs more than the whole budget is granted it alone (it would never fit otherwise)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"`max_concurrency` must be >= 1, got {capacity}.")
        self.capacity = capacity
        self.used = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def _fits(self, amount: int) -> bool:
        return self.used == 0 or self.used + amount <= self.capacity

    async def acquire(self, amount: int) -> int:
        amount = min(amount, self.capacity)
        if not self._waiting and self._fits(amount):
            self.used += amount
            return amount
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append((amount, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(amount)  # granted as it was cancelled
            elif (amount, waiter) in self._waiting:  # a release may have dropped it already
                self._waiting.remove((amount, waiter))
            raise
        return amount

    def release(self, amount: int) -> None:
        self.used -= amount
        while self._waiting and self._fits(self._waiting[0][0]):
            granted, waiter = self._waiting.popleft()
            if not waiter.done():
                self.used += granted
                waiter.set_result(None)


class GroupJudge:
    """`await judge(prompt, responses)` -> `Judged`: the group's rewards from `reward` (a `JudgeReward`) in a worker
    thread, once its requests fit in the budget; `JudgeUnavailable` when the judge server is unreachable or failing
    (`EngineUnavailable`) or takes more than `judge_timeout` seconds from the group's start.

    Example:
    ```python
    >>> judge = GroupJudge(JudgeReward(url, tokenizer, protocol="pairwise", across_processes=False), 64, 1800.0)
    >>> judged = await judge(prompt, ["response 1", "response 2"])
    ```
    """

    def __init__(self, reward, max_concurrency: int, judge_timeout: float):
        self.reward = reward
        self.budget = RequestBudget(max_concurrency)
        self.judge_timeout = judge_timeout
        # Rendering is CPU work under the GIL: one thread, groups in arrival order, ahead of their turn to be sent.
        self._render = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-render")
        # One thread per group judged at once: never more than requests in flight (each group sends one at least).
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="reward-judge")

    async def __call__(self, prompt, responses: list[str]) -> Judged:
        loop = asyncio.get_running_loop()
        # The group's prompts are rendered while it waits for room, so that a judge slot that frees is filled at once.
        prompts = [prompt] * len(responses)
        prepared = await loop.run_in_executor(self._render, self.reward.prepare, prompts, responses)
        rendered = len(prepared.rendered.prompts) if prepared.rendered is not None else 0
        granted = await self.budget.acquire(max(1, rendered))
        try:
            future = loop.run_in_executor(self._pool, self.reward.judge_batch, prompts, responses, prepared)
            try:
                batch = await asyncio.wait_for(asyncio.shield(future), self.judge_timeout)
            except asyncio.TimeoutError:
                raise JudgeUnavailable(
                    f"the judge did not judge the group within --judge-timeout {self.judge_timeout:g} s"
                ) from None
            except EngineUnavailable as error:
                raise JudgeUnavailable(str(error)) from None
        finally:
            self.budget.release(granted)
        if batch.refused:
            logger.warning("The judge server refused %d of the group's requests: their samples are unscored.",
                           batch.refused)  # fmt: skip
        return Judged(batch.rewards, unparsed=batch.unparsed)

    def close(self) -> None:
        self._render.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
