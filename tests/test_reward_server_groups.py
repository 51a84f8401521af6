"""`GroupCollector`, the core of `trl-longrm reward-server`: samples held (awaitables on one event loop) until their
group is whole, each group judged once with all of its samples, an unscored sample given its group's mean and flagged,
an incomplete group judged after the timeout, a retry (the same sample, its first request's connection closed)
adopted rather than counted twice, a failed group never replayed to its retries, a sample contradicting its group
refused alone, and the drain on stop. The HTTP server: tests/test_reward_server.py; verl's and OpenRLHF's own code:
tests/test_rl_frameworks.py."""

from __future__ import annotations

import asyncio

import pytest

from trl_longrm.rewards.server.groups import GroupCollector, Judged, ServerStopping
from trl_longrm.rewards.server.payloads import BadRequest, Sample, openrlhf_response


class Judge:
    """Rewards each response by its length; None for responses starting with '?'; records its calls; fails while
    `down`; takes `delay` seconds."""

    def __init__(self, delay: float = 0.0):
        self.calls, self.down, self.delay = [], False, delay

    async def __call__(self, prompt, responses):
        self.calls.append(list(responses))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.down:
            raise RuntimeError("judge down")
        return Judged([None if r.startswith("?") else float(len(r)) for r in responses])


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def sample(key, response, size=None, prompt="prompt"):
    return Sample(key, prompt, response, size)


async def rewards(collector, key, responses, **kwargs):
    held = [collector.submit(sample(key, r, **kwargs)) for r in responses]
    return await asyncio.gather(*(collector.wait(g, i) for g, i in held))


def test_each_group_is_judged_once_whole():
    async def go():
        judge = Judge(delay=0.01)
        collector = GroupCollector(judge, group_size=3)
        order = [(key, r) for r in ("a", "bb", "ccc") for key in ("u1", "u2")]  # interleaved, as workers send
        held = [collector.submit(sample(key, r)) for key, r in order]
        results = await asyncio.gather(*(collector.wait(g, i) for g, i in held))
        assert sorted(map(sorted, judge.calls)) == [["a", "bb", "ccc"], ["a", "bb", "ccc"]]
        assert dict(zip(order, results))[("u1", "bb")] == (2.0, 0)
        assert dict(zip(order, results))[("u2", "ccc")] == (3.0, 0)
        assert collector.held_samples == 0 and len(collector._live) == 2  # answered, kept until delivered
        for group, index in held:
            collector.deliver(group, index)
        assert not collector._live  # nothing kept once every answer was taken

    run(go())


def test_an_unscored_sample_gets_its_group_mean_and_is_flagged():
    async def go():
        collector = GroupCollector(Judge(), group_size=3)
        assert await rewards(collector, "u", ["a", "?", "ccc"]) == [(1.0, 0), (2.0, 1), (3.0, 0)]
        assert await rewards(collector, "v", ["?", "?x", "?y"]) == [(0.0, 1)] * 3

    run(go())


def test_an_incomplete_group_is_judged_after_the_timeout(caplog):
    async def go():
        judge = Judge()
        collector = GroupCollector(judge, group_size=4, group_timeout=0.2)
        held = [collector.submit(sample("u", r)) for r in ("a", "bb")]
        collector.sweep()
        await asyncio.sleep(0)
        assert judge.calls == []  # not yet
        await asyncio.sleep(0.3)
        collector.sweep()
        assert [await collector.wait(g, i) for g, i in held] == [(1.0, 0), (2.0, 0)]
        assert judge.calls == [["a", "bb"]] and held[0][0].partial

    run(go())
    assert "has 2 of its 4 samples" in caplog.text


def test_a_retry_is_adopted_and_a_live_duplicate_is_not():
    async def go():
        judge = Judge()
        collector = GroupCollector(judge, group_size=3)
        first = collector.submit(sample("u", "same"), alive=lambda: False)  # its client gave up (connection closed)
        retry = collector.submit(sample("u", "same"))
        assert retry == first and len(first[0].samples) == 1 and collector.adopted == 1
        duplicate = collector.submit(sample("u", "same"))  # the retry's connection is alive: another sample
        assert duplicate[1] == 1
        last = collector.submit(sample("u", "other"))
        assert await collector.wait(*last) == (5.0, 0)
        assert judge.calls == [["same", "same", "other"]]

    run(go())


def test_an_answer_missed_by_its_request_goes_to_the_retry():
    async def go():
        judge = Judge()
        collector = GroupCollector(judge, group_size=2)
        gone = collector.submit(sample("u", "aa"), alive=lambda: False)
        other = collector.submit(sample("u", "bbb"))
        await collector.wait(*other)
        collector.deliver(*other)
        retry = collector.submit(sample("u", "aa"))  # "aa"'s request never took its answer
        assert retry == gone and await collector.wait(*retry) == (2.0, 0)
        assert len(judge.calls) == 1
        collector.deliver(*retry)
        assert not collector._live

    run(go())


def test_a_judge_error_reaches_every_request_and_is_never_replayed():
    async def go():
        judge = Judge()
        judge.down = True
        collector = GroupCollector(judge, group_size=2)
        held = [collector.submit(sample("u", r), alive=lambda: False) for r in ("a", "b")]
        for group, index in held:
            with pytest.raises(RuntimeError, match="judge down"):
                await collector.wait(group, index)
        judge.down = False  # the judge is back; the framework sends the same samples again
        assert await rewards(collector, "u", ["a", "b"]) == [(1.0, 0), (1.0, 0)]
        assert len(judge.calls) == 2

    run(go())


def test_a_sample_contradicting_its_group_is_refused_alone():
    async def go():
        collector = GroupCollector(Judge(), group_size=2)
        first = collector.submit(sample("u", "a", size=2))
        with pytest.raises(BadRequest, match="group_size is 3, but its group was opened with 2") as error:
            collector.submit(sample("u", "b", size=3))
        assert error.value.field == "group_size"
        with pytest.raises(BadRequest, match="prompt differs") as error:
            collector.submit(sample("u", "b", size=2, prompt="another prompt"))
        assert error.value.field == "prompt"
        last = collector.submit(sample("u", "bbb", size=2))  # the group is not poisoned
        assert [await collector.wait(*first), await collector.wait(*last)] == [(1.0, 0), (3.0, 0)]

    run(go())


def test_drain_judges_what_is_being_judged_and_answers_the_rest_to_retry():
    async def go():
        collector = GroupCollector(Judge(delay=0.2), group_size=2)
        judging = [collector.submit(sample("whole", r)) for r in ("a", "bb")]
        waiting = collector.submit(sample("incomplete", "c"))
        await asyncio.sleep(0.05)
        assert await collector.drain(timeout=5) == 0
        assert [await collector.wait(*h) for h in judging] == [(1.0, 0), (2.0, 0)]
        with pytest.raises(ServerStopping):
            await collector.wait(*waiting)
        with pytest.raises(ServerStopping):
            collector.submit(sample("new", "d"))

    run(go())


def test_drain_past_its_timeout_answers_the_groups_still_judging_to_retry():
    async def go():
        collector = GroupCollector(Judge(delay=5), group_size=1)
        held = collector.submit(sample("slow", "a"))
        await asyncio.sleep(0.05)
        assert await collector.drain(timeout=0.1) == 1
        with pytest.raises(ServerStopping):
            await collector.wait(*held)

    run(go())


def test_openrlhf_response_is_the_query_after_its_prompt():
    assert openrlhf_response("PROMPT answer here<|im_end|>\n", "PROMPT", ["<|im_end|>"]) == " answer here"


def test_openrlhf_response_after_a_prompt_cut_from_the_front():
    """OpenRLHF keeps a too-long prompt's last tokens: the query starts inside the prompt (maybe inside a character,
    decoded as U+FFFD), and the response is still what follows the prompt."""
    prompt = "<|im_start|>user\n" + "word " * 300 + "Which river? " + "déjà " * 40 + "<|im_end|>\n<|im_start|>assistant\n"
    for cut in (10, 1000, len(prompt) - 20, len(prompt) - 30):
        query = prompt[cut:] + "The Nile, déjà.<|im_end|>"
        assert openrlhf_response(query, prompt, ["<|im_end|>"]) == "The Nile, déjà.", cut
    query = "\ufffd" + prompt[1501:] + "Answer<|im_end|>"
    assert openrlhf_response(query, prompt, ["<|im_end|>"]) == "Answer"


def test_the_judge_budget_grants_in_order_and_a_group_larger_than_it_alone():
    from trl_longrm.rewards.server.judging import RequestBudget

    async def go():
        budget = RequestBudget(4)
        assert await budget.acquire(3) == 3
        order = []

        async def take(name, amount):
            granted = await budget.acquire(amount)
            order.append(name)
            return granted

        big = asyncio.ensure_future(take("big", 10))  # more than the whole budget: granted alone, as 4
        small = asyncio.ensure_future(take("small", 1))  # fits now, but waits its turn behind the big one
        cancelled = asyncio.ensure_future(take("cancelled", 1))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        assert order == [] and budget.used == 3
        budget.release(3)
        assert await big == 4 and order == ["big"] and budget.used == 4
        budget.release(4)
        assert await small == 1 and order == ["big", "small"] and budget.used == 1
        assert cancelled.cancelled()

    run(go())
