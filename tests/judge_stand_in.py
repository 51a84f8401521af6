"""A stand-in judge server for tests and the load bench: OpenAI-compatible (`/v1/models`, `/v1/completions` with
token-id prompts, as `OpenAIGenerator` sends them), each request answered after a fixed latency with the verdict
`judge_steering.verdict_for` gives on the prompt it decodes, as vLLM returns it (generated token ids included); a
response containing `REFUSE` makes its prompt refused with a 400, as vLLM refuses a prompt past its context. The
verdicts are known in advance (`judge_steering.expected_*`), so every reward a test or the bench gets can be checked.

It counts what it served (`/stats`: requests, most in flight at once) and can be told to hang (`POST /hang`) or to
answer again (`POST /recover`); an outage is the process killed (run it as a script for that):

    python tests/judge_stand_in.py --tokenizer DIR [--port 0] [--latency 0.05]   # prints "READY <port>"
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from pathlib import Path

from aiohttp import web


sys.path.insert(0, str(Path(__file__).resolve().parent))

from judge_steering import verdict_for  # noqa: E402


class StandInJudge:
    """The judge's routes on aiohttp; `latency` seconds per completion request."""

    def __init__(self, tokenizer, latency: float = 0.0, max_model_len: int = 4096, name: str = "judge"):
        self.tokenizer, self.latency, self.max_model_len, self.name = tokenizer, latency, max_model_len, name
        self.requests = self.in_flight = self.most_in_flight = 0
        self.hung = asyncio.Event()  # set: every completion request waits until /recover
        self.recovered = asyncio.Event()

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.name, "object": "model", "root": self.name, "max_model_len": self.max_model_len}]})  # fmt: skip

    async def completions(self, request):
        payload = await request.json()
        self.requests += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hung.is_set():
                await self.recovered.wait()
            if self.latency:
                await asyncio.sleep(self.latency)
            prompt = self.tokenizer.decode(payload["prompt"], skip_special_tokens=False)
            if "REFUSE" in prompt.rsplit("# Task", 1)[-1]:  # a prompt the server will not take, as vLLM a too long one
                return web.json_response({"error": {"message": "This prompt is refused (REFUSE)"}}, status=400)
            text = verdict_for(prompt)
            asked = payload.get("logprob_token_ids")
            if asked and payload.get("max_tokens") == 1:
                # The judge's forced pass (the prompt ends with its judgment's verdict opening): the verdict's next
                # token most likely. A judgment's own pass reports no log-probabilities, so the judge always asks.
                inside = text[2:].split("]]")[0] if text.startswith("[[") else ""
                target = self.tokenizer(inside, add_special_tokens=False)["input_ids"][:1] if inside else []
                step = {f"token_id:{t}": 0.0 if [t] == target else -30.0 for t in asked}
                return web.json_response({"choices": [{"index": 0, "text": inside, "token_ids": target,
                                                       "logprobs": {"top_logprobs": [step]}}]})  # fmt: skip
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: payload.get("max_tokens", 16)]
            if len(ids) < payload.get("max_tokens", 16):
                ids.append(self.tokenizer.eos_token_id)
            return web.json_response({"choices": [{"index": 0, "text": text, "token_ids": ids, "logprobs": None,
                                                   "finish_reason": "stop"}]})  # fmt: skip
        finally:
            self.in_flight -= 1

    async def stats(self, request):
        return web.json_response({"requests": self.requests, "most_in_flight": self.most_in_flight,
                                  "in_flight": self.in_flight})  # fmt: skip

    async def hang(self, request):
        self.recovered.clear()
        self.hung.set()
        return web.json_response({"hung": True})

    async def recover(self, request):
        self.hung.clear()
        self.recovered.set()
        return web.json_response({"hung": False})

    async def reset(self, request):
        self.requests = self.most_in_flight = 0
        return web.json_response({"reset": True})

    def application(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/hang", self.hang)
        app.router.add_post("/recover", self.recover)
        app.router.add_post("/reset", self.reset)
        return app


class StandInJudgeThread:
    """The stand-in judge on its own event loop in a thread of this process (`base_url`, `judge`), for tests that do
    not kill it."""

    def __init__(self, tokenizer, latency: float = 0.0, port: int = 0, **kwargs):
        self.judge_args, self.port = (tokenizer, latency, kwargs), port
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="stand-in-judge")

    def _run(self):
        asyncio.set_event_loop(self.loop)
        tokenizer, latency, kwargs = self.judge_args
        self.judge = StandInJudge(tokenizer, latency, **kwargs)
        self.runner = web.AppRunner(self.judge.application(), access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, backlog=4096)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.started.set()
        self.loop.run_forever()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> StandInJudgeThread:
        self.thread.start()
        self.started.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0)
    args = parser.parse_args()
    judge = StandInJudge(AutoTokenizer.from_pretrained(args.tokenizer), args.latency)

    async def run():
        runner = web.AppRunner(judge.application(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=4096)
        await site.start()
        print(f"READY {site._server.sockets[0].getsockname()[1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
