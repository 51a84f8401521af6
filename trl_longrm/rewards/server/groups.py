"""Samples held until their group is whole, each group judged once, every sample then answered with its own reward.

RL frameworks send each sample alone, from many workers, while a pairwise or ranking judge compares a prompt's samples:
`GroupCollector` holds each sample (an awaitable, no thread) until `group_size` samples of its group key have arrived,
has the group judged, and wakes every held request. Everything runs on the server's event loop, so the collector's
state needs no lock; the judging itself runs off the loop (`trl_longrm.rewards.server.judging`).

- A group still incomplete `group_timeout` seconds after its first sample is judged with what arrived (a sample lost,
  validation with fewer samples per prompt), with a warning.
- A retry (the same response of the same group, sent again after its first request's connection closed: OpenRLHF
  retries after its 180 s client timeout) is adopted, never counted twice; an answer its first request could not
  take is kept `keep_answers` seconds for it.
- A group whose judging failed is forgotten at once: its retries form a new group, judged when the judge is back (an
  error is never replayed).
- The group's prompt is stored once (a 128K-token context is not held `group_size` times), and dropped with the
  responses as soon as the group is judged: an answered group keeps only rewards and digests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from trl_longrm.rewards.server.payloads import BadRequest, Sample


logger = logging.getLogger(__name__)


class ServerStopping(Exception):
    """The server is stopping (SIGTERM) before this sample's group was judged: the client should send it again."""


@dataclass(eq=False)
class HeldSample:
    response: str | None
    digest: int
    alive: Callable[[], bool]
    delivered: bool = False


@dataclass(eq=False)
class Group:
    """One group's samples and, once judged, their rewards (or the error that every request of the group gets)."""

    key: str
    size: int
    started: float
    prompt: object
    samples: list[HeldSample] = field(default_factory=list)
    judged: asyncio.Event = field(default_factory=asyncio.Event)
    state: str = "pending"  # pending -> judging -> answered | failed
    partial: bool = False
    rewards: list[float] | None = None
    unscored: list[int] | None = None
    unparsed: int = 0
    error: Exception | None = None
    judged_at: float | None = None


@dataclass
class Judged:
    """What judging a group gave: one reward per response (None: the judge said nothing to score it by)."""

    rewards: list[float | None]
    unparsed: int = 0  # verdicts the judge wrote that could not be read


class GroupCollector:
    """Held samples by group key, each whole group judged once by `judge(prompt, responses)` (a coroutine returning
    `Judged`), each held request then given its own sample's reward.

    An unscored sample (the judge's None) is answered with the mean of its group's scored rewards (0 when none is
    scored), which moves no group baseline (GRPO, RLOO, REINFORCE++ with a baseline give it no advantage), and
    flagged `unscored`: neither verl nor OpenRLHF takes "no reward".

    Example:
    ```python
    >>> collector = GroupCollector(judge, group_size=8)
    >>> group, index = collector.submit(Sample("uid-1", prompt, response), alive=lambda: True)
    >>> reward, unscored = await collector.wait(group, index)
    ```
    """

    def __init__(
        self,
        judge: Callable[[object, list[str]], Awaitable[Judged]],
        group_size: int,
        group_timeout: float = 600.0,
        keep_answers: float = 900.0,
        on_judged: Callable[[Group, float], None] | None = None,
    ):
        if group_size < 1:
            raise ValueError(f"`group_size` must be >= 1, got {group_size}.")
        self.judge = judge
        self.group_size = group_size
        self.group_timeout = group_timeout
        self.keep_answers = keep_answers
        self.on_judged = on_judged
        self._pending: dict[str, Group] = {}
        self._live: dict[str, list[Group]] = {}  # every group a retry may belong to (pending, judging, answered)
        self._tasks: set[asyncio.Task] = set()
        self.stopping = False
        self.adopted = 0  # retries adopted over the collector's life

    # -- state -------------------------------------------------------------------------------------------------------

    @property
    def held_samples(self) -> int:
        """Samples whose request waits for its group's judgment."""
        return sum(len(g.samples) for groups in self._live.values() for g in groups if g.state in ("pending", "judging"))

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    @property
    def judging_groups(self) -> int:
        return sum(g.state == "judging" for groups in self._live.values() for g in groups)

    def _forget(self, group: Group) -> None:
        groups = self._live.get(group.key)
        if groups is not None and group in groups:
            groups.remove(group)
            if not groups:
                del self._live[group.key]

    # -- samples ------------------------------------------------------------------------------------------------------

    def _find_retry(self, sample: Sample, digest: int, alive) -> tuple[Group, int] | None:
        """The held sample this one repeats: same group key and response, not yet delivered, its own request gone."""
        for group in self._live.get(sample.key, ()):
            for index, held in enumerate(group.samples):
                if held.digest != digest or held.delivered or held.alive():
                    continue
                if held.response is not None and held.response != sample.response:
                    continue
                held.alive = alive
                self.adopted += 1
                return group, index
        return None

    def submit(self, sample: Sample, alive: Callable[[], bool] = lambda: True) -> tuple[Group, int]:
        """Hold `sample` (or adopt the request it retries): (group, index) to `wait` on. `BadRequest` for a sample
        that contradicts its group (another group size, another prompt under the same uid); `ServerStopping` while
        the server stops."""
        if self.stopping:
            raise ServerStopping("the reward server is stopping")
        digest = hash(sample.response)
        found = self._find_retry(sample, digest, alive)
        if found is not None:
            return found
        group = self._pending.get(sample.key)
        if group is None:
            group = Group(sample.key, sample.group_size or self.group_size, time.monotonic(), sample.prompt)
            self._pending[sample.key] = group
            self._live.setdefault(sample.key, []).append(group)
        else:
            if sample.group_size is not None and sample.group_size != group.size:
                raise BadRequest(
                    f"group {sample.key!r}: this sample's group_size is {sample.group_size}, but its group was opened "
                    f"with {group.size} (every sample of a group must send the same)", field="group_size",
                )  # fmt: skip
            if sample.prompt != group.prompt:
                raise BadRequest(
                    f"group {sample.key!r}: this sample's prompt differs from the prompt of the group's first sample "
                    "(a uid names one prompt's samples)", field="prompt",
                )  # fmt: skip
        group.samples.append(HeldSample(sample.response, digest, alive))
        index = len(group.samples) - 1
        if len(group.samples) >= group.size:
            self._start(group)
        return group, index

    def _start(self, group: Group, partial: bool = False) -> None:
        del self._pending[group.key]
        group.state, group.partial = "judging", partial
        task = asyncio.get_running_loop().create_task(self._judge(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _judge(self, group: Group) -> None:
        started = time.monotonic()
        try:
            judged = await self.judge(group.prompt, [s.response for s in group.samples])
            rewards = list(judged.rewards)
            if len(rewards) != len(group.samples):
                raise RuntimeError(f"the judge gave {len(rewards)} rewards for {len(group.samples)} samples")
            scored = [r for r in rewards if r is not None]
            fill = sum(scored) / len(scored) if scored else 0.0
            group.unscored = [int(r is None) for r in rewards]
            group.rewards = [fill if r is None else float(r) for r in rewards]
            group.unparsed = judged.unparsed
            group.state = "answered"
        except Exception as error:  # every request of the group gets it; the group is forgotten (never replayed)
            group.error, group.state = error, "failed"
            self._forget(group)
        except asyncio.CancelledError:  # the server stopped before the judge answered
            group.error, group.state = ServerStopping("the reward server stopped while judging the group"), "failed"
            self._forget(group)
            raise
        finally:
            group.prompt = None  # the long context and responses are not kept once judged
            for held in group.samples:
                held.response = None
            group.judged_at = time.monotonic()
            group.judged.set()
        if self.on_judged is not None:
            self.on_judged(group, group.judged_at - started)

    async def wait(self, group: Group, index: int) -> tuple[float, int]:
        """The sample's reward and whether it was unscored, once its group is judged; the judge's error otherwise."""
        await group.judged.wait()
        if group.error is not None:
            raise group.error
        return group.rewards[index], group.unscored[index]

    def deliver(self, group: Group, index: int) -> None:
        """The sample's answer reached its request: nothing is kept for a retry of it."""
        group.samples[index].delivered = True
        if group.state == "answered" and all(held.delivered for held in group.samples):
            self._forget(group)

    # -- time ---------------------------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Judge the groups incomplete `group_timeout` seconds after their first sample with what arrived; forget
        answers kept `keep_answers` seconds for retries that never came."""
        now = time.monotonic()
        for group in [g for g in self._pending.values() if now - g.started >= self.group_timeout]:
            logger.warning(
                "Group %r has %d of its %d samples after %.0f s: judged with those (is --group-size the framework's "
                "samples per prompt, for validation too?).", group.key, len(group.samples), group.size,
                self.group_timeout,
            )  # fmt: skip
            self._start(group, partial=True)
        for groups in list(self._live.values()):
            for group in list(groups):
                if group.state == "answered" and now - group.judged_at >= self.keep_answers:
                    self._forget(group)

    async def drain(self, timeout: float) -> int:
        """Stop taking samples: incomplete groups are answered `ServerStopping` (their clients send them again), the
        groups being judged get up to `timeout` seconds to finish. Returns how many groups were still being judged
        when the time ran out (their requests get `ServerStopping` too)."""
        self.stopping = True
        for group in list(self._pending.values()):
            del self._pending[group.key]
            group.error, group.state = ServerStopping("the reward server stopped before the group was whole"), "failed"
            self._forget(group)
            group.judged.set()
        tasks = list(self._tasks)
        if not tasks:
            return 0
        _, late = await asyncio.wait(tasks, timeout=timeout)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)
        return len(late)
