"""`trl-longrm reward-server` over HTTP (aiohttp), judged by a stand-in judge server whose verdicts are known
(`tests/judge_stand_in.py`, `judge_steering`'s rule), every reward checked against them:

- hundreds of clients at once, a new connection per sample (as verl's manager and OpenRLHF post): every group judged
  once and whole, every reward right, never more requests in flight to the judge than `--max-concurrency` in all;
- OpenRLHF's route, its queries cut from the front as OpenRLHF cuts an over-long prompt;
- bad input refused alone with a 4xx naming the field (no sibling fails, no uid poisoned), slow clients cut, an API
  key required when set, an access-log line per request, `/metrics` and `/health`;
- the judge killed and back (503 with Retry-After, never replayed), hung (503 after `--judge-timeout`), and the two
  judges' calls concurrent (each group's rewards those of judging it alone);
- SIGTERM under load: the groups being judged answered, the rest 503, exit 0 (the command as users start it).

verl's and OpenRLHF's own client code against the server: tests/test_rl_frameworks.py."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import threading
import time
import urllib.request

import judge_steering
import pytest
from judge_stand_in import StandInJudgeThread
from reward_server_helpers import (
    ServerThread,
    body_of,
    judge_process,
    post_each,
    raw_request,
    require_fds,
    server_process,
    status_of,
)

from trl_longrm import JudgeReward
from trl_longrm.evaluation.judges import GenerativeJudge
from trl_longrm.rewards.server.app import ServerSettings
from trl_longrm.serving import OpenAIGenerator
from trl_longrm.testing_utils import build_chat_tokenizer


G = 4


def prompt_of(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: name a river near city {i * 7 % 13}."}]


def responses_of(i: int) -> list[str]:
    return [f"river {i} answer {j} " + "word " * (j + i % 3) for j in range(G)]


def verl_payloads(groups: range, size: int = G) -> list[dict]:
    return [{"uid": f"uid-{i}", "group_size": size, "prompt": prompt_of(i), "response": r}
            for i in groups for r in responses_of(i)]  # fmt: skip


def expected(groups: range) -> list[float]:
    return [r for i in groups for r in judge_steering.expected_pairwise(responses_of(i))]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward_server") / "judge"
    build_chat_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def judge(tokenizer_dir):
    from transformers import AutoTokenizer

    with StandInJudgeThread(AutoTokenizer.from_pretrained(tokenizer_dir), latency=0.02) as running:
        yield running


def reward_of(judge_url, tokenizer_dir, protocol="pairwise", max_concurrency=8, **kwargs):
    return JudgeReward(judge_url, tokenizer_dir, model="judge", protocol=protocol, max_length=4096, max_new_tokens=16,
                       across_processes=False, max_concurrency=max_concurrency, max_retries=0, **kwargs)  # fmt: skip


def settings(**overrides) -> ServerSettings:
    values = {"group_size": G, "max_concurrency": 8, "header_timeout": 1.0, "read_timeout": 1.0,
              "max_body_bytes": 2**20, "group_timeout": 30.0, **overrides}  # fmt: skip
    return ServerSettings(**values)


@pytest.fixture(scope="module")
def server(judge, tokenizer_dir):
    with ServerThread(reward_of(judge.base_url, tokenizer_dir), settings()) as running:
        yield running


def metric(url: str, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith(f"trl_longrm_reward_server_{name}{want} "):
            return float(line.split()[-1])
    return 0.0


def test_hundreds_of_connections_get_every_groups_reward(server, judge):
    """256 samples at once (64 groups of 4, interleaved as workers finish them), a new connection each: each group
    judged once and whole, every reward the judge's (win rates in both display orders); at most 8 judge requests in
    flight over all groups."""
    require_fds(2 * 256 + 128)  # the clients' ends and the server's, in this process
    groups = range(64)
    payloads = verl_payloads(groups)
    order = sorted(range(len(payloads)), key=lambda k: (k % G, k // G))  # sample j of every group, then j + 1
    before = metric(server.url, "groups_total", outcome="whole")
    answers = asyncio.run(post_each(f"{server.url}/verl", [payloads[k] for k in order]))
    by_sample = dict(zip(order, answers))
    assert all(by_sample[k][0] == 200 for k in by_sample), [a for a in answers if a[0] != 200][:3]
    assert [by_sample[k][1]["score"] for k in range(len(payloads))] == pytest.approx(expected(groups))
    assert all(by_sample[k][1]["unscored"] == 0 for k in by_sample)
    assert metric(server.url, "groups_total", outcome="whole") - before == len(groups)
    assert metric(server.url, "groups_total", outcome="partial") == 0
    assert 1 < judge.judge.most_in_flight <= 8


def test_openrlhf_route_with_queries_cut_from_the_front(server, tokenizer_dir):
    """OpenRLHF posts `{query, prompts, labels}`, the query the prompt then the response with special tokens; a
    prompt over its `--max_len` is cut from the front, so the query starts inside the prompt. Every sample gets its
    group's reward, as scalars; `scores` are the rewards on [0, 1]."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    groups = range(100, 116)
    payloads = []
    for i in groups:
        text = tok.apply_chat_template(prompt_of(i) + [{"role": "user", "content": "More: " + "context " * 40}],
                                       add_generation_prompt=True, tokenize=False)  # fmt: skip
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for j, response in enumerate(responses_of(i)):
            kept = ids[-(len(ids) - 7 * j) :] if j else ids  # OpenRLHF's `prompt_token_ids[-max_prompt_length:]`
            query = tok.decode(kept + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            payloads.append({"query": [query], "prompts": [text], "labels": [""]})
    answers = asyncio.run(post_each(f"{server.url}/get_reward", payloads))
    assert all(status == 200 for status, _ in answers)
    # The judge reads the whole prompt and the response: the same rewards as verl's route on the same texts.
    expected_rewards = [r for i in groups for r in judge_steering.expected_pairwise(responses_of(i))]
    assert [body["rewards"] for _, body in answers] == pytest.approx(expected_rewards)
    assert [body["scores"] for _, body in answers] == pytest.approx(expected_rewards)
    assert all(body["extra_logs"] == {"judge/unscored": 0} for _, body in answers)
    [(status, body)] = asyncio.run(post_each(f"{server.url}/get_reward", [{"query": ["a", "b", "c"], "prompts": ["p"]}]))
    assert status == 400 and body["field"] == "prompts" and "1 entries for 3 queries" in body["error"]


def http(method: str, path: str, body: bytes, headers: dict | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    if "Content-Length" not in (headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


BAD = [
    ("a body said to be 99,999,999,999 bytes", http("POST", "/verl", b"{}", {"Content-Length": "99999999999"}), 413, None),
    ("a negative Content-Length", http("POST", "/verl", b"{}", {"Content-Length": "-1"}), 400, "Content-Length"),
    ("JSON nested 200,000 deep", http("POST", "/verl", b"[" * 200_000), 400, None),
    ("not JSON", http("POST", "/verl", b"{uid: 1"), 400, None),
    ("not UTF-8", http("POST", "/verl", b'{"uid": "\xff"}'), 400, None),
    ("a body over --max-body-bytes", http("POST", "/verl", b'{"x": "' + b"a" * 2**21 + b'"}'), 413, None),
    ("a JSON list", http("POST", "/verl", b"[1, 2]"), 400, None),
    ("group_size as text", http("POST", "/verl", json.dumps({**verl_payloads(range(1))[0], "group_size": "2"}).encode()), 400, "group_size"),
    ("a negative group_size", http("POST", "/verl", json.dumps({**verl_payloads(range(1))[0], "group_size": -5}).encode()), 400, "group_size"),
    ("a group_size over --max-group-size", http("POST", "/verl", json.dumps({**verl_payloads(range(1))[0], "group_size": 10**6}).encode()), 400, "group_size"),
    ("a uid of true", http("POST", "/verl", json.dumps({**verl_payloads(range(1))[0], "uid": True}).encode()), 400, "uid"),
    ("a response that is a number", http("POST", "/verl", json.dumps({**verl_payloads(range(1))[0], "response": 3}).encode()), 400, "response"),
    ("a message without content", http("POST", "/verl", json.dumps({**verl_payloads(range(1))[0], "prompt": [{"role": "user"}]}).encode()), 400, "prompt"),
    ("an unknown field", http("POST", "/verl", json.dumps({**verl_payloads(range(1))[0], "extra": 1}).encode()), 400, "extra"),
    ("no response", http("POST", "/verl", json.dumps({"uid": "x", "prompt": "p"}).encode()), 400, "response"),
    ("an unknown path", http("POST", "/v1/anything", b"{}"), 404, None),
    ("GET on a POST route", http("GET", "/verl", b""), 405, None),
]  # fmt: skip


@pytest.mark.parametrize("name, request_bytes, status, field", BAD, ids=[case[0] for case in BAD])
def test_bad_input_is_refused_with_a_4xx_naming_the_field(server, name, request_bytes, status, field):
    started = time.monotonic()
    answer = raw_request(server.server.port, request_bytes)
    assert status_of(answer) == status, answer[:300]
    body = body_of(answer)
    assert "error" in body
    if field == "Content-Length":  # refused by aiohttp's HTTP parser, which names the header
        assert "Content-Length" in body["error"]
    elif field is not None:
        assert body["field"] == field and field in body["error"]
    assert time.monotonic() - started < 5  # answered, not hung


def test_a_bad_sample_fails_neither_its_siblings_nor_its_uid(server):
    """A sample with a non-text prompt, one with `group_size` "2": each refused alone; its group's valid samples (4,
    the uid the bad ones named) are judged whole and rewarded as without them."""
    payloads = verl_payloads(range(200, 201))
    bad = [{**payloads[0], "prompt": {"text": 1}}, {**payloads[1], "group_size": "2"}]
    answers = asyncio.run(post_each(f"{server.url}/verl", bad + payloads))
    assert [status for status, _ in answers[:2]] == [400, 400]
    assert [answers[0][1]["field"], answers[1][1]["field"]] == ["prompt", "group_size"]
    assert [body["score"] for _, body in answers[2:]] == pytest.approx(expected(range(200, 201)))


def test_slow_clients_are_cut_and_do_not_hold_up_the_others(server):
    """A connection that never finishes its request head is closed after --header-timeout (1 s here), a body that
    never arrives is answered 408 after --read-timeout; 200 of them open at once do not delay a normal request."""
    require_fds(2 * 200 + 128)
    slow = [socket.create_connection(("127.0.0.1", server.server.port)) for _ in range(200)]
    for sock in slow:
        sock.sendall(b"POST /verl HTTP/1.1\r\nHost: x\r\n")  # no end of head
    body_late = socket.create_connection(("127.0.0.1", server.server.port))
    body_late.sendall(b"POST /verl HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    started = time.monotonic()
    [(status, _)] = asyncio.run(post_each(f"{server.url}/verl", [{**verl_payloads(range(300, 301))[0], "group_size": 1}]))
    assert status == 200 and time.monotonic() - started < 5
    body_late.settimeout(10)
    answer = body_late.recv(65536)
    assert status_of(answer) == 408 and "--read-timeout" in body_of(answer)["error"]
    time.sleep(1.5)
    closed = 0
    for sock in slow:
        sock.settimeout(5)
        try:
            closed += sock.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        sock.close()
    assert closed == len(slow)


def test_health_and_metrics(server):
    health = json.loads(urllib.request.urlopen(f"{server.url}/health", timeout=10).read())
    assert health["status"] == "ok" and "answered 200" in health["judge"] and health["held_samples"] == 0
    text = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
    for name in ("requests_total", "samples_total", "groups_total", "group_timeouts_total", "unscored_samples_total",
                 "judge_seconds_bucket", "request_seconds_bucket", "held_samples", "judge_requests_in_flight",
                 "bad_requests_total"):  # fmt: skip
        assert f"trl_longrm_reward_server_{name}" in text, name


def test_an_api_key_is_required_when_set_and_each_request_is_logged(judge, tokenizer_dir, caplog):
    reward = reward_of(judge.base_url, tokenizer_dir)
    with caplog.at_level(logging.INFO, logger="trl_longrm.reward_server.access"):
        with ServerThread(reward, settings(api_key="sekret", group_size=1)) as running:
            payload = [{**verl_payloads(range(400, 401))[0], "group_size": 1}]
            [(status, body)] = asyncio.run(post_each(f"{running.url}/verl", payload))
            assert status == 401 and "API key" in body["error"]
            [(status, _)] = asyncio.run(post_each(f"{running.url}/verl", payload, {"Authorization": "Bearer wrong"}))
            assert status == 401
            [(status, body)] = asyncio.run(post_each(f"{running.url}/verl", payload, {"Authorization": "Bearer sekret"}))
            assert status == 200 and body["unscored"] == 1  # a group of one: nothing to compare, its own mean (0)
            assert status_of(raw_request(running.server.port, http("GET", "/metrics", b""))) == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "trl_longrm.reward_server.access"]
    assert sum('"POST /verl HTTP/1.1" 401' in line for line in lines) == 2
    assert sum('"POST /verl HTTP/1.1" 200' in line for line in lines) == 1


def test_a_hung_judge_fails_its_group_after_the_judge_timeout(judge, tokenizer_dir):
    urllib.request.urlopen(urllib.request.Request(f"{judge.base_url[:-3]}/hang", method="POST"), timeout=10)
    try:
        with ServerThread(reward_of(judge.base_url, tokenizer_dir), settings(judge_timeout=1.0)) as running:
            started = time.monotonic()
            answers = asyncio.run(post_each(f"{running.url}/verl", verl_payloads(range(500, 501))))
            assert [status for status, _ in answers] == [503] * G and time.monotonic() - started < 10
            assert "--judge-timeout" in answers[0][1]["error"]
            urllib.request.urlopen(urllib.request.Request(f"{judge.base_url[:-3]}/recover", method="POST"), timeout=10)
            answers = asyncio.run(post_each(f"{running.url}/verl", verl_payloads(range(500, 501))))
            assert [body["score"] for _, body in answers] == pytest.approx(expected(range(500, 501)))
    finally:
        urllib.request.urlopen(urllib.request.Request(f"{judge.base_url[:-3]}/recover", method="POST"), timeout=10)


def judge_on(judge, tok, protocol: str) -> GenerativeJudge:
    engine = OpenAIGenerator(judge.base_url, "judge", tokenizer=tok, max_concurrency=16)
    return GenerativeJudge(engine, tok, max_length=4096, max_new_tokens=16, protocol=protocol,
                           verdict_probs=protocol == "pointwise")  # fmt: skip


# Groups the judge server takes whole (odd) and in part (even: two responses whose prompts it refuses).
CONCURRENT_GROUPS = [(prompt_of(i), responses_of(i) if i % 2 else [*responses_of(i)[:2], "REFUSE this", "REFUSE that"])
                     for i in range(8)]  # fmt: skip


@pytest.mark.parametrize("protocol", ["pairwise", "pointwise"])
def test_concurrent_groups_get_the_rewards_of_each_alone(judge, tokenizer_dir, protocol):
    """One judge, groups judged at once from 8 threads (as the server judges them), threads switching every few
    bytecodes: each group gets the rewards of judging it alone. Pointwise reads expected scores (a judgment's pass,
    then a forced pass reading the score tokens' probabilities)."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    generative = judge_on(judge, AutoTokenizer.from_pretrained(tokenizer_dir), protocol)
    reward = JudgeReward(generative, protocol=protocol)
    alone = [reward.judge_batch([p] * G, rs).rewards for p, rs in CONCURRENT_GROUPS]
    for (_, rs), rewards in zip(CONCURRENT_GROUPS[1::2], alone[1::2]):  # the judge's own rewards
        wanted = judge_steering.expected_pairwise(rs) if protocol == "pairwise" else [judge_steering.quality(r) % 10 for r in rs]
        assert rewards == pytest.approx(wanted, abs=1e-6)
    assert all(a[2:] == [None, None] for a in alone[0::2])
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(8) as pool:
            for _ in range(3):
                together = list(pool.map(lambda g: reward.judge_batch([g[0]] * G, g[1]).rewards, CONCURRENT_GROUPS))
                assert together == alone
    finally:
        sys.setswitchinterval(interval)
    assert generative.refusals == "raise"  # the caller's judge keeps its own rule; JudgeReward judges with a copy


def test_a_call_between_anothers_answer_and_its_reading_leaves_it_its_own_refusals(judge, tokenizer_dir):
    """The worst interleaving, made to happen: a group the server takes whole is stopped right after its answers
    came back (at its first decode), while a group with refused prompts is judged start to end; the first then
    reads its own answers (a judge keeping a call's refusals on itself would give it the other call's)."""
    import copy

    from transformers import AutoTokenizer

    tok = copy.copy(AutoTokenizer.from_pretrained(tokenizer_dir))
    other_done = threading.Event()
    decode = tok.decode

    def gated_decode(*args, **kwargs):
        if threading.current_thread().name == "whole-group" and not other_done.is_set():
            assert other_done.wait(30)
        return decode(*args, **kwargs)

    tok.decode = gated_decode
    reward = JudgeReward(judge_on(judge, tok, "pairwise"), protocol="pairwise")
    (whole_prompt, whole), (part_prompt, part) = CONCURRENT_GROUPS[1], CONCURRENT_GROUPS[0]
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("whole", reward.judge_batch([whole_prompt] * G, whole)),
                             name="whole-group")  # fmt: skip
    first.start()
    got["part"] = reward.judge_batch([part_prompt] * G, part)
    other_done.set()
    first.join(30)
    assert got["whole"].rewards == pytest.approx(judge_steering.expected_pairwise(whole))
    assert got["whole"].refused == 0 and got["part"].refused == 10  # the 10 comparisons showing a refused response
    assert got["part"].rewards[2:] == [None, None]


def test_judge_reward_refuses_what_a_generative_judge_cannot_take(judge, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    generative = GenerativeJudge(OpenAIGenerator(judge.base_url, "judge"), tok, max_length=4096, max_new_tokens=16)
    for given, named in [({"max_length": 2048}, "max_length=2048"), ({"max_new_tokens": 8}, "max_new_tokens=8"),
                         ({"template": "other.yaml"}, "template"), ({"batch_size": 4}, "batch_size=4"),
                         ({"max_concurrency": 4}, "max_concurrency=4"), ({"tokenizer": build_chat_tokenizer()}, "tokenizer"),
                         ({"verdict_probs": False}, "verdict_probs=False")]:  # fmt: skip
        with pytest.raises(TypeError, match=named):
            JudgeReward(generative, **given)
    JudgeReward(generative, tokenizer=tok, max_length=4096)  # the judge's own values, given again: taken
    with pytest.raises(TypeError, match="batch_size"):
        JudgeReward(OpenAIGenerator(judge.base_url, "judge"), tok, batch_size=4)


@pytest.mark.slow
def test_a_judge_outage_answers_503_then_the_same_requests_succeed(tokenizer_dir):
    """The judge server killed: the group's requests get 503 with Retry-After and /health says so; the judge back on
    the same port, the same requests (as the frameworks retry them) get the right rewards: no error replayed."""
    from trl_longrm.serving.server import free_port

    port = free_port()
    with judge_process(tokenizer_dir, port=port) as (url, first):
        with server_process(url, tokenizer_dir, "--group-size", str(G), "--request-timeout", "5") as (_, server_url, log):
            first.kill()
            first.wait()
            answers = asyncio.run(post_each(f"{server_url}/verl", verl_payloads(range(600, 601))))
            assert [status for status, _ in answers] == [503] * G, answers
            assert "Cannot reach the server" in answers[0][1]["error"]
            health = urllib.request.Request(f"{server_url}/health")
            with pytest.raises(urllib.error.HTTPError) as unhealthy:
                urllib.request.urlopen(health, timeout=10)
            assert unhealthy.value.code == 503 and "judge unreachable" in unhealthy.value.read().decode()
            with judge_process(tokenizer_dir, port=port):
                answers = asyncio.run(post_each(f"{server_url}/verl", verl_payloads(range(600, 601))))
                assert [body.get("score") for _, body in answers] == pytest.approx(expected(range(600, 601)))
                assert json.loads(urllib.request.urlopen(health, timeout=10).read())["status"] == "ok"
                assert metric(server_url, "judge_errors_total", kind="unavailable") == 1
    assert "Judging group 'uid-600' (4 samples) failed" in log.read_text()


@pytest.mark.slow
def test_sigterm_drains_held_groups_and_exits(tokenizer_dir):
    """SIGTERM while 3 whole groups are being judged (1 s a judge request) and 2 are incomplete: no new connection
    is taken, the judged groups' requests get their rewards, the incomplete ones 503 (to be sent again), the process
    exits 0; no request is left without an answer."""
    with judge_process(tokenizer_dir, latency=1.0) as (url, _):
        with server_process(url, tokenizer_dir, "--group-size", str(G)) as (process, server_url, log):
            whole = verl_payloads(range(700, 703))
            incomplete = verl_payloads(range(703, 705))[:3] + verl_payloads(range(704, 705))[:2]
            results = {}

            def post():
                results["answers"] = asyncio.run(post_each(f"{server_url}/verl", whole + incomplete, timeout=60))

            client = threading.Thread(target=post)
            client.start()
            time.sleep(1.0)
            process.send_signal(signal.SIGTERM)
            client.join(60)
            assert process.wait(30) == 0
    answers = results["answers"]
    assert [body.get("score") for _, body in answers[: len(whole)]] == pytest.approx(expected(range(700, 703)))
    assert [status for status, _ in answers[len(whole) :]] == [503] * len(incomplete)
    assert "ServerStopping" in answers[-1][1]["error"]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(server_url.rsplit(":", 1)[1])), timeout=2).close()
    assert "Stopping: no new connections" in log.read_text()
