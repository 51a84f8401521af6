"""The OpenAI-compatible client (`trl_longrm.serving.openai_engine`, on the `openai` package) against a local stand-in
server that answers as we script it: a 429's `Retry-After` is waited for, connections are kept alive, a refused
prompt comes back as its own `Generation.refusal` (the others of the batch are kept), the server's `max_model_len` is
read, a served tokenizer that is not the local one is refused with both names, and no `repr` shows the API key."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_longrm.serving import EngineError, OpenAIGenerator
from trl_longrm.serving.openai_engine import _TOKENIZER_PROBE


SECRET = "sk-test-secret-0123"


class StandIn:
    """A scripted `/v1` server: `/v1/models`, `/tokenize` (with `tokens`), `/v1/completions` answering `[[A]]` as
    token ids, a 400 for a prompt holding `refuse_token`, and `busy` 429s (with `Retry-After`) before answering."""

    def __init__(self, tokens=None, busy=0, retry_after="2", refuse_token=-1, text_steps=None):
        self.tokens, self.busy, self.retry_after, self.refuse_token = tokens, busy, retry_after, refuse_token
        self.text_steps = text_steps
        self.connections, self.posts, self.times, self.auth = set(), 0, [], []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real server

            def _answer(self, status, payload, headers=()):
                body = json.dumps(payload).encode()
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                owner.connections.add(self.client_address)
                self._answer(200, {"data": [{"id": "judge", "root": "/models/judge", "max_model_len": 4096}]})

            def do_POST(self):
                owner.connections.add(self.client_address)
                owner.auth.append(self.headers.get("Authorization"))
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    if owner.tokens is None:
                        return self._answer(404, {"detail": "Not Found"})
                    return self._answer(200, {"tokens": owner.tokens})
                owner.posts += 1
                owner.times.append(time.monotonic())
                if owner.busy:
                    owner.busy -= 1
                    return self._answer(429, {"error": "busy"}, [("Retry-After", owner.retry_after)])
                if owner.refuse_token in payload["prompt"]:
                    return self._answer(400, {"error": {"message": "This model's maximum context length is 4096"}})
                if owner.text_steps is not None:  # a server without vLLM's fields: text and its own token strings
                    if "return_token_ids" in payload:
                        return self._answer(400, {"error": "unknown field return_token_ids"})
                    pieces, steps = owner.text_steps
                    choice = {"text": "".join(pieces), "logprobs": {"tokens": pieces, "top_logprobs": steps}}
                else:
                    choice = {"text": "[[A]]", "token_ids": [7, 8, 9], "logprobs": None}
                self._answer(200, {"choices": [choice]})

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_port}/v1"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_retry_after_is_honoured():
    """Two 429s asking for 2 s each: the client waits them out (not its own 0.5 s / 1 s backoff) and then succeeds."""
    with StandIn(busy=2, retry_after="2") as server:
        engine = OpenAIGenerator(server.base_url, "judge", max_retries=3)
        start = time.monotonic()
        [generation] = engine.generate([[1, 2, 3]], 4)
        assert generation.token_ids == [7, 8, 9] and generation.refusal is None
        gaps = [b - a for a, b in zip(server.times, server.times[1:])]
        assert server.posts == 3 and all(gap >= 1.9 for gap in gaps), gaps
        assert time.monotonic() - start < 8


def test_retries_give_up_with_one_error():
    with StandIn(busy=10, retry_after="0.2") as server:
        engine = OpenAIGenerator(server.base_url, "judge", max_retries=1)
        with pytest.raises(EngineError, match="429"):
            engine.generate([[1, 2, 3]], 4)
        assert server.posts == 2


def test_connections_are_kept_alive():
    with StandIn() as server:
        engine = OpenAIGenerator(server.base_url, "judge", max_concurrency=1)
        engine.generate([[1], [2], [3], [4]], 4)
        assert server.posts == 4 and len(server.connections) == 1


def test_a_refused_prompt_is_its_own():
    """A 400 for one prompt: that prompt's `refusal` says why; the others are generated."""
    with StandIn(refuse_token=99) as server:
        engine = OpenAIGenerator(server.base_url, "judge")
        out = engine.generate([[1, 2], [1, 99], [3]], 4)
        assert [g.refusal is None for g in out] == [True, False, True]
        assert "maximum context length" in out[1].refusal and out[1].token_ids == []
        assert out[0].token_ids == [7, 8, 9]


def test_server_context_and_checkpoint_are_read():
    with StandIn() as server:
        engine = OpenAIGenerator(server.base_url, "judge")
        assert engine.max_model_len == 4096 and engine.served_checkpoint == "/models/judge"


def test_a_served_tokenizer_other_than_the_local_one_is_refused(tokenizer):
    local = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    with StandIn(tokens=local) as server:  # the same ids: accepted
        OpenAIGenerator(server.base_url, "judge", tokenizer=tokenizer)
    with StandIn(tokens=local[:-1] + [local[-1] + 1]) as server:
        with pytest.raises(EngineError, match=r"/models/judge.*other than the local one"):
            OpenAIGenerator(server.base_url, "judge", tokenizer=tokenizer)


def test_the_api_key_is_sent_and_never_shown():
    with StandIn() as server:
        engine = OpenAIGenerator(server.base_url, "judge", api_key=SECRET)
        engine.generate([[1]], 2)
        assert server.auth[-1] == f"Bearer {SECRET}"
        for shown in (repr(engine), repr(engine.server), str(engine.identity()), repr(vars(engine))):
            assert SECRET not in shown


def test_no_config_repr_shows_the_api_key():
    from trl_longrm.evaluation import EvalConfig

    config = EvalConfig(model_path="judge", data_path="data", backend="openai", base_url="http://x/v1", api_key=SECRET)
    assert SECRET not in repr(config) and SECRET not in str(config) and config.api_key == SECRET


def test_text_servers_steps_are_read_only_where_they_align(tokenizer):
    """A server returning text and top log-probabilities by token string (not vLLM): its steps are read at the
    re-tokenized ids when its tokens are ours, step for step; when they split the text otherwise, no step is read (the
    judge then reads the verdict with its forced one-token pass) instead of reading a step at the wrong token."""
    verdict = tokenizer("[[B]]", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([t]) for t in verdict]
    letter = verdict.index(tokenizer("B", add_special_tokens=False)["input_ids"][0])
    a_id, b_id = (tokenizer(x, add_special_tokens=False)["input_ids"][0] for x in "AB")
    steps = [{piece: -0.1} for piece in pieces]
    steps[letter] = {"B": -0.2, "A": -1.7}
    with StandIn(text_steps=(pieces, steps)) as server:
        engine = OpenAIGenerator(server.base_url, "judge", tokenizer=tokenizer)
        [aligned] = engine.generate([[1, 2]], 8, logprob_token_ids=[a_id, b_id])
        assert aligned.token_ids == verdict and aligned.logprobs[letter] == {a_id: -1.7, b_id: -0.2}
    other = ["[", "[B", "]]"]  # the same text in other tokens than ours
    with StandIn(text_steps=(other, [{}, {"[B": -0.1}, {"]]": -0.1}])) as server:
        engine = OpenAIGenerator(server.base_url, "judge", tokenizer=tokenizer)
        [misaligned] = engine.generate([[1, 2]], 8, logprob_token_ids=[a_id, b_id])
        assert misaligned.token_ids == verdict and all(step == {} for step in misaligned.logprobs)
