"""`trl-longrm reward-server`: a group-aware HTTP reward server for RL frameworks that ask for one sample's reward at
a time (OpenRLHF's remote reward model, verl's reward loop through `trl_longrm.rewards.verl.JudgeRewardManager`).

A pairwise or ranking judge compares a prompt's samples, but these frameworks send each sample alone, from many
workers. The server holds each sample until its whole group has arrived (`group_size` samples of the same group key:
verl's `uid`, OpenRLHF's prompt text), judges the group once with `JudgeReward`, and answers every held request with
its own sample's reward. A group still incomplete `group_timeout` seconds after its first sample (a sample lost, a
validation run with fewer samples per prompt) is judged with what arrived, with a warning.

Neither framework takes "no reward": a sample the judge left unscored (`JudgeReward`'s None) is answered with the mean
of its group's scored rewards (0 when none is scored), which moves no group baseline (GRPO, RLOO, REINFORCE++ with a
baseline give it no advantage), and flagged (`unscored`: 1, logged). OpenRLHF retries a request after 180 s (its
client's timeout): a sample whose first request's connection has closed is adopted by its retry rather than counted
twice, and an answer its first request could not receive is given to the retry.

Example:
```bash
trl-longrm reward-server --base-url http://127.0.0.1:8000/v1 --served-model judge --tokenizer ./LongReward_Qwen3-8B \
    --protocol pairwise --group-size 8 --port 5000
```
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    prompt: object
    completion: str
    alive: Callable[[], bool]
    delivered: bool = False


@dataclass
class _Group:
    key: str
    size: int
    started: float
    samples: list[_Sample] = field(default_factory=list)
    judged: threading.Event = field(default_factory=threading.Event)
    judging: bool = False
    rewards: list | None = None
    unscored: list | None = None
    error: str | None = None


class GroupCollector:
    """Samples held by group key until their group is whole, each group judged once by `judge(prompts, completions)
    -> rewards` (None for unscored), every sample then given its reward.

    Example:
    ```python
    >>> collector = GroupCollector(JudgeReward(...).judge_batch_rewards, group_size=8)
    >>> reward, unscored = collector.reward("uid-1", prompt, completion)  # blocks until the group is judged
    ```
    """

    def __init__(self, judge: Callable[[list, list], list], group_size: int, group_timeout: float = 600.0,
                 keep_answers: float = 900.0):  # fmt: skip
        if group_size < 1:
            raise ValueError(f"`group_size` must be >= 1, got {group_size}.")
        self.judge = judge
        self.group_size = group_size
        self.group_timeout = group_timeout
        self.keep_answers = keep_answers
        self._lock = threading.Lock()
        self._pending: dict[str, _Group] = {}
        self._answered: list[_Group] = []  # judged groups, kept a while for retries that missed their answer
        self.groups_judged = 0
        self.partial_groups = 0

    def _find_retry(self, key: str, completion: str, alive) -> tuple[_Group, int] | None:
        """A sample of `key` with this completion whose first request is gone (its connection closed before it got
        an answer): the new request is its retry."""
        candidates = [self._pending[key]] if key in self._pending else []
        candidates += [g for g in self._answered if g.key == key]
        for group in candidates:
            for index, sample in enumerate(group.samples):
                if sample.completion == completion and not sample.delivered and not sample.alive():
                    sample.alive = alive
                    return group, index
        return None

    def submit(self, key: str, prompt, completion: str, group_size: int | None = None, alive=lambda: True):
        """Add a sample (or adopt its earlier request); returns (group, index) to `wait` on."""
        with self._lock:
            now = time.monotonic()
            self._answered = [g for g in self._answered if now - g.started < self.keep_answers]
            found = self._find_retry(key, completion, alive)
            if found is not None:
                return found
            group = self._pending.get(key)
            if group is None:
                group = self._pending[key] = _Group(key, group_size or self.group_size, now)
            group.samples.append(_Sample(prompt, completion, alive))
            index = len(group.samples) - 1
            whole = len(group.samples) >= group.size
            if whole:
                del self._pending[key]
                group.judging = True
        if whole:
            self._judge(group)
        return group, index

    def _judge(self, group: _Group) -> None:
        try:
            rewards = list(self.judge([s.prompt for s in group.samples], [s.completion for s in group.samples]))
            scored = [r for r in rewards if r is not None]
            fill = sum(scored) / len(scored) if scored else 0.0
            group.unscored = [int(r is None) for r in rewards]
            group.rewards = [fill if r is None else float(r) for r in rewards]
        except Exception as error:  # every request of the group gets it, and the server's log says it
            logger.error("Judging group %r failed: %s: %s", group.key, type(error).__name__, error)
            group.error = f"{type(error).__name__}: {error}"
        with self._lock:
            self.groups_judged += 1
            self._answered.append(group)
        group.judged.set()

    def sweep(self) -> None:
        """Judge the groups incomplete `group_timeout` seconds after their first sample, with what arrived."""
        with self._lock:
            now = time.monotonic()
            late = [g for g in self._pending.values() if now - g.started >= self.group_timeout]
            for group in late:
                del self._pending[group.key]
                group.judging = True
                self.partial_groups += 1
        for group in late:
            logger.warning(
                "Group %r has %d of its %d samples after %.0f s: judged with those (is --group-size the framework's "
                "samples per prompt, for validation too?).", group.key, len(group.samples), group.size,
                self.group_timeout,
            )  # fmt: skip
            self._judge(group)

    def wait(self, group: _Group, index: int, timeout: float | None = None) -> tuple[float, int]:
        """The sample's reward and whether it was unscored, once its group is judged; `RuntimeError` with the
        judge's error."""
        if not group.judged.wait(timeout):
            raise TimeoutError(f"group {group.key!r} not judged within {timeout} s")
        if group.error:
            raise RuntimeError(group.error)
        return group.rewards[index], group.unscored[index]

    def reward(self, key: str, prompt, completion: str, group_size: int | None = None) -> tuple[float, int]:
        group, index = self.submit(key, prompt, completion, group_size)
        result = self.wait(group, index)
        group.samples[index].delivered = True
        return result


def _connection_alive(sock: socket.socket) -> Callable[[], bool]:
    """Whether the client still holds the connection: a closed one reads as end-of-file without blocking."""

    def alive() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return not readable or sock.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False

    return alive


def openrlhf_response(query: str, prompt: str, special: list[str]) -> str:
    """The response in OpenRLHF's query (the prompt, then the response decoded with special tokens): the text after the
    prompt, without trailing special tokens of the judge's tokenizer (the policy's end-of-turn token)."""
    response = query[len(prompt) :] if query.startswith(prompt) else query
    stripped = True
    while stripped:
        stripped = False
        response = response.rstrip()
        for token in special:
            if token and response.endswith(token):
                response = response[: -len(token)]
                stripped = True
    return response


def make_server(reward, group_size: int, host: str = "127.0.0.1", port: int = 5000, group_timeout: float = 600.0):
    """The HTTP server of `reward` (a `JudgeReward`), not yet serving: `POST /verl` takes
    `{"uid", "group_size", "prompt", "response"}` (the `JudgeRewardManager`'s request) and answers
    `{"score", "unscored"}`; any other `POST` path is OpenRLHF's remote reward model (`{"query", "prompts",
    "labels"}` in, `{"rewards", "scores", "extra_logs"}` out, grouped by prompt text). `GET /health` answers 200."""
    special = sorted(reward.judge.tokenizer.all_special_tokens, key=len, reverse=True)
    collector = GroupCollector(lambda prompts, completions: reward.judge_batch(prompts, completions).rewards,
                               group_size, group_timeout)  # fmt: skip
    low, high = reward.judge.template.pointwise_format.scale if reward.protocol == "pointwise" else (0, 1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the client is gone; its retry gets the answer

        def do_GET(self):
            self._send(200 if self.path.rstrip("/") == "/health" else 404, {"status": "ok"})

        def do_POST(self):
            try:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                alive = _connection_alive(self.connection)
                if self.path.rstrip("/") == "/verl":
                    samples = [(str(payload["uid"]), payload["prompt"], payload["response"], payload.get("group_size"))]
                else:
                    queries, prompts = payload["query"], payload["prompts"]
                    samples = [(p, p, openrlhf_response(q, p, special), None) for q, p in zip(queries, prompts)]
            except (KeyError, TypeError, ValueError) as error:
                return self._send(400, {"error": f"bad request: {type(error).__name__}: {error}"})
            try:
                held = [collector.submit(key, prompt, text, size, alive) for key, prompt, text, size in samples]
                results = [collector.wait(group, index) for group, index in held]
            except RuntimeError as error:
                return self._send(500, {"error": str(error)})
            if not alive():
                return  # the client gave up: its retry (same sample) is answered from the kept group
            for group, index in held:
                group.samples[index].delivered = True
            rewards = [r for r, _ in results]
            unscored = [u for _, u in results]
            if self.path.rstrip("/") == "/verl":
                return self._send(200, {"score": rewards[0], "unscored": unscored[0]})
            scores = [(r - low) / (high - low) for r in rewards]
            one = len(rewards) == 1  # OpenRLHF sends one sample and reads scalars
            self._send(200, {
                "rewards": rewards[0] if one else rewards,
                "scores": scores[0] if one else scores,
                "extra_logs": {"judge/unscored": unscored[0] if one else unscored},
            })  # fmt: skip

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.collector = collector

    def sweep_forever():
        while True:
            time.sleep(1.0)
            collector.sweep()

    threading.Thread(target=sweep_forever, daemon=True, name="reward-server-sweep").start()
    return server


def add_reward_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="The judge server's OpenAI-compatible base URL (…/v1).")
    parser.add_argument("--served-model", default=None, help="The served judge's name (default: the only one).")
    parser.add_argument("--tokenizer", required=True, help="The judge checkpoint's path, for its tokenizer.")
    parser.add_argument("--protocol", default="pairwise", choices=["pairwise", "ranking", "pointwise"])
    parser.add_argument("--group-size", type=int, required=True,
                        help="Samples per prompt: OpenRLHF's --rollout.n_samples_per_prompt, verl's rollout.n.")
    parser.add_argument("--group-timeout", type=float, default=600.0,
                        help="Seconds after a group's first sample before it is judged with what arrived.")
    parser.add_argument("--template", default=None, help="A prompt template YAML file (default: the built-in).")
    parser.add_argument("--max-length", type=int, default=131072, help="The judge's context (cut to the server's).")
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="The longest judgment.")
    parser.add_argument("--no-verdict-probs", dest="verdict_probs", action="store_false",
                        help="Pointwise: reward the parsed score, not the expected one.")
    parser.add_argument("--max-concurrency", type=int, default=8, help="Requests in flight to the judge server.")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="Seconds per judge request.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)


def run_reward_server(args: argparse.Namespace) -> int:
    from trl_longrm.rewards.judge import JudgeReward

    reward = JudgeReward(args.base_url, args.tokenizer, model=args.served_model, protocol=args.protocol,
                         template=args.template, max_length=args.max_length, max_new_tokens=args.max_new_tokens,
                         verdict_probs=args.verdict_probs, max_concurrency=args.max_concurrency,
                         timeout=args.request_timeout, across_processes=False)  # fmt: skip
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = make_server(reward, args.group_size, args.host, args.port, args.group_timeout)
    print(f"Reward server on http://{args.host}:{server.server_port} (groups of {args.group_size}, {args.protocol} "
          f"judge at {args.base_url})", file=sys.stderr, flush=True)  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
