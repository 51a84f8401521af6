"""`JudgeReward` (a generative judge as a GRPO reward) against a real vLLM server: through TRL's own
`GRPOTrainer._calculate_rewards` it equals the rewards computed by hand from a direct call of the judge; each group's
context is prefilled once (the server's own `/metrics` counters); unparsed verdicts are counted and leave their rows
unscored (None); a request the server refuses leaves its rows unscored and the rest of the step is kept; requests are
cut to the server's `max_model_len`; a transformers judge generates `batch_size` prompts at a time; a server down or
too slow is one `EngineError`, quickly. The parsed-verdict rules are checked on a judge steered to write chosen
verdicts; several processes in tests/test_judge_reward_processes.py."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from vllm_support import VLLM_SHAPE, vllm_server

from trl_longrm import JudgeReward
from trl_longrm.evaluation.judges import TRUNCATION_MARGIN, GenerativeJudge, JudgeRequest
from trl_longrm.evaluation.prompts import parse_pairwise_verdict
from trl_longrm.serving import EngineError, OpenAIGenerator
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model, steer_generation


_WORDS = "the city river number name year color animal planet capital author book price height".split()
MAX_LENGTH, MAX_NEW_TOKENS, G = 4096, 8, 3


def sentence(seed: int, n: int) -> str:
    return " ".join(_WORDS[(seed * 7 + 3 * i) % len(_WORDS)] for i in range(n))


CONVERSATIONAL = [
    [{"role": "system", "content": "Answer from the text."}, {"role": "user", "content": sentence(1, 60)}],
    [{"role": "user", "content": sentence(2, 40)}],
]


def batch(prompts, conversational=True):
    """GRPO's layout: each prompt's G generations consecutive."""
    ps, cs = [], []
    for i, prompt in enumerate(prompts):
        for g in range(G):
            text = sentence(10 * i + g, 3 + 4 * g)
            ps.append(prompt)
            cs.append([{"role": "assistant", "content": text}] if conversational else text)
    return ps, cs


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge_reward")
    tokenizer = build_chat_tokenizer()
    return {
        "judge": save_tiny_model(root / "judge", arch="qwen3", tokenizer=tokenizer, seed=3, **VLLM_SHAPE),
        "policy": save_tiny_model(root / "policy", tokenizer=tokenizer, seed=6),
    }


@pytest.fixture(scope="module")
def server(paths):
    # One server for the module (a start takes a minute here), with the prefix cache the reward relies on.
    with vllm_server(paths["judge"], "--enable-prefix-caching", served_model_name="judge") as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(paths):
    return AutoTokenizer.from_pretrained(paths["judge"])


def engine(server):
    return OpenAIGenerator(server.base_url, "judge")


def reward_on(server, tokenizer, **kwargs):
    return JudgeReward(engine(server), tokenizer, max_length=MAX_LENGTH, max_new_tokens=MAX_NEW_TOKENS, **kwargs)


def grpo_trainer(paths, reward, tmp_path, prompts):
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                      per_device_train_batch_size=G, num_generations=G, max_completion_length=4)  # fmt: skip
    return GRPOTrainer(model=paths["policy"], reward_funcs=[reward], args=args,
                       train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))  # fmt: skip


def task_of(messages):  # the evaluation's task text, written out here as an independent reference
    return "\n\n".join(m["content"] for m in messages)


@pytest.mark.slow
def test_grpo_pairwise_rewards_are_the_known_verdicts_win_rates(paths, tokenizer, tmp_path):
    """Pairwise rewards computed by TRL's `_calculate_rewards` are each completion's win rate under a judge whose
    verdicts are known in advance (a stand-in server writing `judge_steering`'s verdict for every prompt it reads):
    the win rates by hand from the rule, over both display orders. A swapped winner, a wrong display order or a reward
    on another row changes them (the completions' qualities all differ, so every comparison has a winner)."""
    import judge_steering
    from judge_stand_in import StandInJudgeThread

    ps, cs = batch(CONVERSATIONAL)
    with StandInJudgeThread(tokenizer) as stand_in:
        reward = JudgeReward(OpenAIGenerator(stand_in.base_url, "judge"), tokenizer, max_length=MAX_LENGTH,
                             max_new_tokens=16, protocol="pairwise")  # fmt: skip
        trainer = grpo_trainer(paths, reward, tmp_path, CONVERSATIONAL)
        got = trainer._calculate_rewards([{"prompt": p} for p in ps], ps, cs, [[0]] * len(ps))[:, 0]
    expected = []
    for start in range(0, len(ps), G):
        expected += judge_steering.expected_pairwise([c[0]["content"] for c in cs[start : start + G]])
    assert None not in expected and len(set(expected)) > 2
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)
    assert trainer._pending_metrics["judge/unparsed_verdicts"] == [0.0]


@pytest.mark.slow
def test_grpo_pointwise_rewards_equal_the_judge_by_hand(paths, server, tokenizer, tmp_path):
    """Pointwise rewards (expected scores) computed by TRL's `_calculate_rewards` equal those computed here from a
    direct call of a `GenerativeJudge` on the same vLLM server, row by row."""
    ps, cs = batch(CONVERSATIONAL)
    reward = reward_on(server, tokenizer, protocol="pointwise")
    trainer = grpo_trainer(paths, reward, tmp_path, CONVERSATIONAL)
    got = trainer._calculate_rewards([{"prompt": p} for p in ps], ps, cs, [[0]] * len(ps))[:, 0]
    direct = GenerativeJudge(engine(server), tokenizer, max_length=MAX_LENGTH, max_new_tokens=MAX_NEW_TOKENS,
                             verdict_probs=True, protocol="pointwise")  # fmt: skip
    expected, unparsed = [], 0  # None where nothing the judge said scores the row
    for start in range(0, len(ps), G):
        task, texts = task_of(ps[start]), [c[0]["content"] for c in cs[start : start + G]]
        requests = [JudgeRequest("x", ps[start], task, [t], ranking=False) for t in texts]
        outputs = direct.judge(requests)
        expected += [out.scores[0] for out in outputs]
        unparsed += sum(direct.template.pointwise_format.parse(out.judgments[0]) is None for out in outputs)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-4, rtol=0, equal_nan=True)
    assert trainer._pending_metrics["judge/unparsed_verdicts"] == [float(unparsed)]
    assert got.std() > 1e-3  # continuous, per completion: a wrong row order would show


def metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"{server.base_url.removesuffix('/v1')}/metrics", timeout=30).read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache") or line.startswith("vllm:prompt_tokens"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            totals[name] = totals.get(name, 0.0) + value
    return totals


@pytest.mark.slow
@pytest.mark.parametrize("warm_prefix", [False, True], ids=["together", "warm_prefix"])
def test_each_group_context_is_prefilled_once(server, tokenizer, warm_prefix):
    """The server's own counters: of one group's pairwise requests (G(G-1) of them, all starting with the same long
    context), the cached prompt tokens cover the context of all but (at most) one, whether the requests go out
    together (the default) or after the context alone (`warm_prefix`)."""
    # A context of its own for each case: the other case's is in the cache.
    long_prompt = [{"role": "user", "content": f"Case {warm_prefix}. " + sentence(5 + warm_prefix, 1800)}]
    ps, cs = batch([long_prompt])
    reward = reward_on(server, tokenizer, protocol="pairwise", warm_prefix=warm_prefix)
    requests, _, _ = reward._requests(ps, cs)
    prompt_ids = reward._group_prompt_ids(requests)
    shared = next(i for i in range(min(map(len, prompt_ids))) if len({ids[i] for ids in prompt_ids}) > 1)
    assert shared > 1500  # the context dominates: block rounding is a small part of it
    before = metrics(server)
    reward.rewards(ps, cs)
    after = metrics(server)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    n = len(prompt_ids)
    assert n == G * (G - 1)
    # The cache holds whole blocks (vLLM's CPU block is up to 128 tokens): each hit covers the context but its last,
    # partial block. More is cached when a request reuses another's first response too (sent one after another).
    assert hits >= (n - 1) * (shared - 128), (hits, queries, shared, n)
    # What the server prefilled: all prompt tokens it was asked for less the cached ones, about one context.
    assert queries - hits <= shared + sum(len(ids) - shared for ids in prompt_ids) + 128 * (n + 1), (hits, queries)


@pytest.mark.slow
def test_unparsed_verdicts_are_counted_and_unscored(server, tokenizer, caplog):
    """The random judge writes no verdict: every comparison is unreadable, counted, logged and warned about, and a row
    without any readable comparison is unscored (None: GRPO gives it no advantage), never a made-up 0.5."""
    ps, cs = batch(CONVERSATIONAL)
    reward = reward_on(server, tokenizer, protocol="pairwise")
    batch_result = reward.judge_batch(ps, cs)
    unparsed = sum(parse_pairwise_verdict(out.text) is None for out in batch_result.outputs)
    assert unparsed == batch_result.unparsed and unparsed > 0 and batch_result.verdicts == 2 * G * (G - 1)
    logged = {}
    with caplog.at_level(logging.WARNING, logger="trl_longrm.rewards.judge"):
        rewards = asyncio.run(reward(prompts=ps, completions=cs, log_metric=logged.__setitem__))
    assert logged["judge/unparsed_verdicts"] == unparsed
    assert logged["judge/unparsed_fraction"] == pytest.approx(unparsed / batch_result.verdicts)
    assert logged["judge/unscored_rows"] == sum(r is None for r in rewards) == batch_result.unscored
    assert f"{unparsed} of {batch_result.verdicts} judge verdicts could not be read" in caplog.text
    if unparsed == batch_result.verdicts:
        assert rewards == [None] * len(ps)


@pytest.mark.slow
def test_server_context_cuts_requests_and_a_refusal_keeps_the_step(server, tokenizer, caplog):
    """The server takes 4096 tokens (`--max-model-len`): `JudgeReward` left at `max_length=131072` reads that from
    `/v1/models` and cuts a 6,000-token group to fit (scored, with a warning); a `GenerativeJudge` given as it is, whose
    prompts are longer than the server takes, has that group's requests refused: its rows are unscored (None, counted),
    the other group's rewards are kept."""
    long_prompt = [{"role": "user", "content": "Long. " + sentence(9, 3000)}]
    ps, cs = batch([long_prompt, CONVERSATIONAL[1]])
    with caplog.at_level(logging.WARNING, logger="trl_longrm.rewards.judge"):
        fitted = JudgeReward(engine(server), tokenizer, protocol="pointwise", max_new_tokens=MAX_NEW_TOKENS)
    assert fitted.judge.max_length == 4096 and "fewer than max_length=131072" in caplog.text
    requests, _, _ = fitted._requests(ps, cs)
    # The long group is cut to head + tail (LongRM's cut) so that prompt + judgment fit in 4096.
    assert max(map(len, fitted._group_prompt_ids(requests))) == 4096 - MAX_NEW_TOKENS - TRUNCATION_MARGIN
    fitted_rewards = fitted.rewards(ps, cs)
    assert None not in fitted_rewards

    unfitted = JudgeReward(GenerativeJudge(engine(server), tokenizer, max_length=8192, max_new_tokens=MAX_NEW_TOKENS,
                                           protocol="pointwise"), protocol="pointwise")  # fmt: skip
    logged = {}
    rewards = unfitted.rewards(ps, cs, log_metric=logged.__setitem__)
    assert rewards[:G] == [None] * G
    assert rewards[G:] == pytest.approx(fitted_rewards[G:], abs=1e-4)
    assert logged["judge/refused_requests"] == G and logged["judge/unscored_rows"] == G


@pytest.mark.parametrize(
    "protocol,script,expected,unparsed",
    [
        # Always "A": each completion wins when shown first and loses when shown second (position bias cancelled).
        ("pairwise", "[[A]]", [0.5, 0.5, 0.5], 0),
        # B first, A second, C last: (G-1-rank)/(G-1) in batch order.
        ("ranking", "[[B>A>C]]", [0.5, 1.0, 0.0], 0),
        ("pointwise", "[[7]]", [7.0, 7.0, 7.0], 0),
        ("pointwise", "no score", [None, None, None], 3),  # no score: unscored, not the scale's middle
        ("ranking", "[[B>A]]", [None, None, None], 1),  # not every label: unparsable, the group unscored
    ],
)
def test_parsed_verdict_rules(paths, tokenizer, protocol, script, expected, unparsed):
    """A transformers judge steered to write `script` (then its own EOS-free continuation is cut by the token
    budget): the documented reward of each verdict."""
    ids = tokenizer(script, add_special_tokens=False)["input_ids"]
    model = steer_generation(AutoModelForCausalLM.from_pretrained(paths["judge"]), ids)
    reward = JudgeReward(model, tokenizer, protocol=protocol, max_length=MAX_LENGTH, max_new_tokens=len(ids),
                         verdict_probs=False)  # fmt: skip
    ps, cs = batch(CONVERSATIONAL[:1])
    logged = {}
    rewards = reward.rewards(ps, cs, log_metric=logged.__setitem__)
    assert rewards == pytest.approx(expected)
    assert logged["judge/unparsed_verdicts"] == unparsed
    assert logged["judge/unscored_rows"] == expected.count(None)


def test_a_group_of_one_is_unscored(paths, tokenizer):
    """Nothing to compare: no request, None (was 0.5)."""
    ids = tokenizer("[[A]]", add_special_tokens=False)["input_ids"]
    model = steer_generation(AutoModelForCausalLM.from_pretrained(paths["judge"]), ids)
    for protocol in ("pairwise", "ranking"):
        reward = JudgeReward(model, tokenizer, protocol=protocol, max_length=MAX_LENGTH, max_new_tokens=len(ids))
        batch_result = reward.judge_batch(CONVERSATIONAL[:1], [[{"role": "assistant", "content": "alone"}]])
        assert batch_result.rewards == [None] and batch_result.requests == []


def test_transformers_judge_generates_batch_size_prompts_at_a_time(paths, tokenizer):
    """A pairwise group of 3 is 6 prompts: with batch_size=4, two `generate` calls (4 + 2 rows), the same rewards as
    all at once."""
    ids = tokenizer("[[B]]", add_special_tokens=False)["input_ids"]
    model = steer_generation(AutoModelForCausalLM.from_pretrained(paths["judge"]), ids)
    sizes, generate = [], model.generate

    def counted(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        return generate(*args, **kwargs)

    model.generate = counted
    ps, cs = batch(CONVERSATIONAL[:1])
    bounded = JudgeReward(model, tokenizer, max_length=MAX_LENGTH, max_new_tokens=len(ids), batch_size=4)
    rewards = bounded.rewards(ps, cs)
    assert sizes == [4, 2]
    sizes.clear()
    whole = JudgeReward(model, tokenizer, max_length=MAX_LENGTH, max_new_tokens=len(ids), batch_size=64)
    assert whole.rewards(ps, cs) == rewards == [0.5] * G and sizes == [6]


def test_grpo_groups_shuffled_rows(paths, tokenizer, tmp_path):
    """Through GRPO's `_calculate_rewards`, rows of two prompts interleaved: each prompt's rows still form one group,
    displayed in their batch order, and each reward lands on its own row (a steered ranking, `[[B>A>C]]`)."""
    ids = tokenizer("[[B>A>C]]", add_special_tokens=False)["input_ids"]
    model = steer_generation(AutoModelForCausalLM.from_pretrained(paths["judge"]), ids)
    reward = JudgeReward(model, tokenizer, protocol="ranking", max_length=MAX_LENGTH, max_new_tokens=len(ids))
    ps, cs = batch(CONVERSATIONAL)
    order = [0, 3, 4, 1, 5, 2]  # rows of prompt 0 at 0, 3, 5; of prompt 1 at 1, 2, 4
    ps, cs = [ps[i] for i in order], [cs[i] for i in order]
    trainer = grpo_trainer(paths, reward, tmp_path, CONVERSATIONAL)
    got = trainer._calculate_rewards([{"prompt": p} for p in ps], ps, cs, [[0]] * len(ps))[:, 0]
    # In each group, the second row in batch order (B) is best, the first (A) second, the third (C) last.
    torch.testing.assert_close(got, torch.tensor([0.5, 0.5, 1.0, 1.0, 0.0, 0.0]))
    assert trainer._pending_metrics["judge/unparsed_verdicts"] == [0.0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_down_is_one_quick_error(tokenizer):
    start = time.monotonic()
    with pytest.raises(EngineError, match="Cannot reach the server"):
        JudgeReward(f"http://127.0.0.1:{free_port()}/v1", tokenizer, model="judge", timeout=2, max_retries=1)
    assert time.monotonic() - start < 10


class _Slow(BaseHTTPRequestHandler):
    def do_GET(self):  # `/v1/models` answers at once: the engine starts
        self._answer({"data": [{"id": "judge"}]})

    def do_POST(self):  # completions come too late (no `/tokenize`: not vLLM)
        if self.path == "/tokenize":
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        time.sleep(4)
        self._answer({"choices": []})

    def _answer(self, payload):
        body = json.dumps(payload).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up

    def log_message(self, *args):
        pass


def test_slow_server_is_one_timeout_error(tokenizer):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        reward = JudgeReward(f"http://127.0.0.1:{httpd.server_port}/v1", tokenizer, model="judge", timeout=1,
                             max_retries=0, max_length=MAX_LENGTH, max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
        ps, cs = batch(CONVERSATIONAL[:1])
        start = time.monotonic()
        with pytest.raises(EngineError, match="did not answer within 1 s"):
            asyncio.run(reward(prompts=ps, completions=cs))
        assert time.monotonic() - start < 4
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.slow
def test_verl_and_openrlhf_entry_points_match(paths, server, tokenizer, monkeypatch):
    """verl's per-sample `compute_score` (keyword arguments, as its `naive` manager calls it) and OpenRLHF's
    `reward_func`, set up by the environment, give `JudgeReward`'s pointwise rewards for the same samples (their own
    calling code: tests/test_rl_frameworks.py)."""
    from trl_longrm.rewards.openrlhf import reward_func
    from trl_longrm.rewards.verl import compute_score

    for key, value in {"URL": server.base_url, "MODEL": "judge", "TOKENIZER": paths["judge"], "PROTOCOL": "pointwise",
                       "MAX_LENGTH": str(MAX_LENGTH), "MAX_NEW_TOKENS": str(MAX_NEW_TOKENS)}.items():  # fmt: skip
        monkeypatch.setenv(f"TRL_LONGRM_JUDGE_{key}", value)
    reference = reward_on(server, tokenizer, protocol="pointwise")

    ps, cs = batch(CONVERSATIONAL)
    expected = reference.rewards(ps, cs)
    assert torch.tensor(expected).std() > 1e-3
    got = [compute_score(data_source="longrm", solution_str=c[0]["content"], ground_truth=None, extra_info={"prompt": p})
           for p, c in zip(ps, cs)]  # fmt: skip
    assert got == pytest.approx(expected, abs=1e-4)

    plain = [sentence(3, 50) + " Answer:", sentence(4, 30) + " Answer:"]
    ps, cs = batch(plain, conversational=False)
    expected = reference.rewards(ps, cs)
    # OpenRLHF's queries are prompt + response, here with the policy's end-of-turn token kept; one sample per call.
    for p, c, want in zip(ps, cs, expected):
        result = reward_func(queries=[p + c + "<|im_end|>"], prompts=[p], labels=[""])
        assert result["rewards"].tolist() == pytest.approx([want], abs=1e-4)
        assert result["scores"].tolist() == pytest.approx([want / 9], abs=1e-4)
        assert {"judge/unparsed_verdicts", "judge/unscored_rows"} <= set(result["extra_logs"])

    # One sample per call: a pairwise judge has nothing to compare, and says so (at ERROR, through OpenRLHF's catch-all).
    monkeypatch.setenv("TRL_LONGRM_JUDGE_PROTOCOL", "pairwise")
    with pytest.raises(ValueError, match="TRL_LONGRM_JUDGE_PROTOCOL=pointwise"):
        reward_func(queries=[ps[0] + cs[0]], prompts=ps[:1], labels=[""])
    with pytest.raises(ValueError, match="TRL_LONGRM_JUDGE_PROTOCOL=pointwise"):
        compute_score(data_source="longrm", solution_str=cs[0], ground_truth=None, extra_info={"prompt": ps[0]})
