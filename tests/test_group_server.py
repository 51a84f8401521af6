"""`GroupCollector`, the core of `trl-longrm reward-server`: samples held until their group is whole, each group judged
once with all of its samples, an unscored sample given its group's mean and flagged, an incomplete group judged after
the timeout, and a retry (the same sample, its first request's connection closed) adopted rather than counted twice.
The server itself, driven by verl's and OpenRLHF's own code: tests/test_rl_frameworks.py."""

from __future__ import annotations

import threading
import time

import pytest

from trl_longrm.rewards.group_server import GroupCollector, openrlhf_response


class Judge:
    """Rewards each completion by its length; None for completions starting with '?'; records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions):
        self.calls.append(list(completions))
        return [None if c.startswith("?") else float(len(c)) for c in completions]


def submit_all(collector, key, completions):
    held = [collector.submit(key, "prompt", c) for c in completions]
    return [collector.wait(group, index, timeout=5) for group, index in held]


def test_each_group_is_judged_once_whole():
    judge = Judge()
    collector = GroupCollector(judge, group_size=3)
    results = {}

    def one(key, completion):
        results[(key, completion)] = collector.reward(key, "prompt", completion)

    threads = [threading.Thread(target=one, args=(key, c)) for c in ("a", "bb", "ccc") for key in ("u1", "u2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(map(sorted, judge.calls)) == [["a", "bb", "ccc"], ["a", "bb", "ccc"]]
    assert results[("u1", "bb")] == (2.0, 0) and results[("u2", "ccc")] == (3.0, 0)


def test_an_unscored_sample_gets_its_group_mean_and_is_flagged():
    collector = GroupCollector(Judge(), group_size=3)
    assert submit_all(collector, "u", ["a", "?", "ccc"]) == [(1.0, 0), (2.0, 1), (3.0, 0)]
    assert submit_all(collector, "v", ["?", "?x", "?y"]) == [(0.0, 1)] * 3


def test_an_incomplete_group_is_judged_after_the_timeout(caplog):
    judge = Judge()
    collector = GroupCollector(judge, group_size=4, group_timeout=0.2)
    held = [collector.submit("u", "prompt", c) for c in ("a", "bb")]
    collector.sweep()
    assert judge.calls == []  # not yet
    time.sleep(0.3)
    collector.sweep()
    assert [collector.wait(g, i, timeout=1) for g, i in held] == [(1.0, 0), (2.0, 0)]
    assert judge.calls == [["a", "bb"]] and collector.partial_groups == 1
    assert "has 2 of its 4 samples" in caplog.text


def test_a_retry_is_adopted_and_a_live_duplicate_is_not():
    judge = Judge()
    collector = GroupCollector(judge, group_size=3)
    first = collector.submit("u", "prompt", "same", alive=lambda: False)  # its client gave up (connection closed)
    retry = collector.submit("u", "prompt", "same")
    assert retry == first and len(first[0].samples) == 1
    duplicate = collector.submit("u", "prompt", "same")  # the retry's connection is alive: another sample
    assert duplicate[1] == 1
    last = collector.submit("u", "prompt", "other")
    assert judge.calls == [["same", "same", "other"]]
    assert collector.wait(*last, timeout=1) == (5.0, 0)


def test_an_answer_missed_by_its_request_goes_to_the_retry():
    judge = Judge()
    collector = GroupCollector(judge, group_size=2)
    gone = collector.submit("u", "prompt", "aa", alive=lambda: False)
    collector.submit("u", "prompt", "bbb")  # the group is judged; "aa"'s request never took its answer
    retry = collector.submit("u", "prompt", "aa")
    assert retry == gone and collector.wait(*retry, timeout=1) == (2.0, 0)
    assert len(judge.calls) == 1


def test_a_judge_error_reaches_every_request():
    def failing(prompts, completions):
        raise RuntimeError("server down")

    collector = GroupCollector(failing, group_size=2)
    held = [collector.submit("u", "prompt", c) for c in ("a", "b")]
    for group, index in held:
        with pytest.raises(RuntimeError, match="server down"):
            collector.wait(group, index, timeout=1)


def test_openrlhf_response_is_the_query_after_its_prompt():
    assert openrlhf_response("PROMPT answer here<|im_end|>\n", "PROMPT", ["<|im_end|>"]) == " answer here"
