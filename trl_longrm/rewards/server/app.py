"""The reward server's HTTP side, on aiohttp's server (one event loop: no thread per connection, no `select()`):
routes, the checks every request passes before it is held, the answers, `/health` and `/metrics`, and the stop on
SIGTERM.

Routes: `POST /verl` (`trl_longrm.rewards.verl.JudgeRewardManager`'s request), `POST /get_reward` (OpenRLHF's
`--reward.remote_url`), `GET /health`, `GET /metrics`; any other path is a 404. Answers are JSON; an error answer is
`{"error": ..., "field": ...}` with a status that says whose it is: 4xx the request's (alone: it never joins a group),
503 with `Retry-After` the judge's or a stopping server's (the same request succeeds later), 500 a bug of ours.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from dataclasses import dataclass, field

from aiohttp import ClientSession, ClientTimeout, web

from trl_longrm.rewards.server.groups import Group, GroupCollector, ServerStopping
from trl_longrm.rewards.server.judging import GroupJudge, JudgeUnavailable
from trl_longrm.rewards.server.metrics import ServerMetrics
from trl_longrm.rewards.server.payloads import BadRequest, openrlhf_samples, parse_json, verl_sample
from trl_longrm.serving.base import EngineError


logger = logging.getLogger("trl_longrm.reward_server")
access_logger = logging.getLogger("trl_longrm.reward_server.access")
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf'
# OpenRLHF's client gives a reward request 180 s (a fixed `aiohttp.ClientTimeout(total=180)` in
# openrlhf/utils/agent.py, no flag), then tries again 1 s later, 5 tries in all.
OPENRLHF_CLIENT_TIMEOUT = 180.0
OPENRLHF_TRIES = 5


@dataclass
class ServerSettings:
    """What `trl-longrm reward-server` is started with (its flags; `add_reward_server_arguments` documents each)."""

    group_size: int
    group_timeout: float = 600.0
    judge_timeout: float = 1800.0
    max_concurrency: int = 64
    max_group_size: int = 1024
    max_body_bytes: int = 16 * 2**20
    header_timeout: float = 60.0
    read_timeout: float = 60.0
    retry_after: int = 5
    drain_timeout: float = 60.0
    keep_answers: float = 900.0
    backlog: int = 4096
    api_key: str | None = field(default=None, repr=False)


def _alive(request: web.BaseRequest):
    """Whether the request's client still holds its connection (aiohttp drops the transport when it closes)."""

    def alive() -> bool:
        transport = request.transport
        return transport is not None and not transport.is_closing()

    return alive


class RewardServer:
    """A judge's rewards served over HTTP, each group of samples judged whole (`GroupCollector`), at most
    `max_concurrency` requests in flight to the judge (`GroupJudge`).

    Example:
    ```python
    >>> reward = JudgeReward("http://127.0.0.1:8000/v1", "./judge", protocol="pairwise", across_processes=False)
    >>> server = RewardServer(reward, ServerSettings(group_size=8))
    >>> await server.start("127.0.0.1", 5000)
    >>> ...
    >>> await server.stop()   # drains: held groups judged or answered 503, then closed
    ```
    """

    def __init__(self, reward, settings: ServerSettings):
        self.reward = reward
        self.settings = settings
        self.judge = GroupJudge(reward, settings.max_concurrency, settings.judge_timeout)
        self.collector = GroupCollector(self.judge, settings.group_size, settings.group_timeout,
                                        settings.keep_answers, on_judged=self._judged)  # fmt: skip
        self.metrics = ServerMetrics(state=self._state)
        tokenizer = reward.judge.tokenizer
        self.special_tokens = sorted(tokenizer.all_special_tokens, key=len, reverse=True)
        self.scale = reward.judge.template.pointwise_format.scale if reward.protocol == "pointwise" else (0, 1)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self._health: tuple[float, bool, str] | None = None
        self._session = None  # the aiohttp client session of the judge's requests while serving
        self._engine_server = None  # the judge engine's own transport, given back on stop
        self.port: int | None = None

    # -- state and metrics ------------------------------------------------------------------------------------------

    def _state(self) -> dict:
        return {"held_samples": self.collector.held_samples, "pending_groups": self.collector.pending_groups,
                "judging_groups": self.collector.judging_groups,
                "judge_requests_in_flight": self.judge.budget.used}  # fmt: skip

    def _judged(self, group: Group, seconds: float) -> None:
        if group.error is not None:
            kind = "unavailable" if isinstance(group.error, JudgeUnavailable) else type(group.error).__name__
            self.metrics.groups.labels(outcome="failed").inc()
            self.metrics.judge_errors.labels(kind=kind).inc()
            logger.error("Judging group %r (%d samples) failed: %s", group.key, len(group.samples), group.error)
            return
        self.metrics.groups.labels(outcome="partial" if group.partial else "whole").inc()
        if group.partial:
            self.metrics.timeouts.inc()
        self.metrics.judge_seconds.observe(seconds)
        self.metrics.unparsed.inc(group.unparsed)
        waited = group.judged_at - group.started
        if waited > OPENRLHF_CLIENT_TIMEOUT:
            logger.warning(
                "Group %r was answered %.0f s after its first sample (judging took %.0f s): past OpenRLHF's fixed %.0f "
                "s client timeout, so OpenRLHF's samples get their rewards at its retries (%d tries, 1 s apart; no "
                "OpenRLHF flag changes it). Judge faster (--max-concurrency, a larger judge server) or shorten groups.",
                group.key, waited, seconds, OPENRLHF_CLIENT_TIMEOUT, OPENRLHF_TRIES,
            )  # fmt: skip

    # -- requests ------------------------------------------------------------------------------------------------------

    async def _body(self, request: web.Request):
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BadRequest(f"the body is {request.content_length} bytes, over --max-body-bytes {limit}", status=413)
        try:
            async with asyncio.timeout(self.settings.read_timeout):
                body = await request.read()
        except TimeoutError:
            raise BadRequest(f"the body did not arrive within --read-timeout {self.settings.read_timeout:g} s",
                             status=408) from None  # fmt: skip
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(f"the body is over --max-body-bytes {limit}", status=413) from None
        return parse_json(body)

    async def _rewards(self, samples, request: web.Request) -> list[tuple[float, int]]:
        alive = _alive(request)
        held = []
        adopted = self.collector.adopted
        for sample in samples:
            held.append(self.collector.submit(sample, alive))
        self.metrics.retries.inc(self.collector.adopted - adopted)
        results = await asyncio.gather(*(self.collector.wait(group, index) for group, index in held))
        if alive():
            for group, index in held:
                self.collector.deliver(group, index)
        else:
            logger.info("A client went before its answer; kept %g s for its retry.", self.settings.keep_answers)
        self.metrics.samples.inc(len(results))
        self.metrics.unscored.inc(sum(unscored for _, unscored in results))
        return results

    async def verl(self, request: web.Request) -> web.Response:
        sample = verl_sample(await self._body(request), self.settings.max_group_size)
        [(reward, unscored)] = await self._rewards([sample], request)
        return web.json_response({"score": reward, "unscored": unscored})

    async def openrlhf(self, request: web.Request) -> web.Response:
        samples = openrlhf_samples(await self._body(request), self.special_tokens)
        results = await self._rewards(samples, request)
        low, high = self.scale
        rewards = [reward for reward, _ in results]
        scores = [(reward - low) / (high - low) for reward in rewards]
        unscored = [flag for _, flag in results]
        one = len(results) == 1  # OpenRLHF's executor sends one sample and reads scalars
        return web.json_response({
            "rewards": rewards[0] if one else rewards,
            "scores": scores[0] if one else scores,
            "extra_logs": {"judge/unscored": unscored[0] if one else unscored},
        })  # fmt: skip

    async def health(self, request: web.Request) -> web.Response:
        if self.collector.stopping:
            return web.json_response({"status": "stopping"}, status=503)
        reachable, detail = await self._judge_reachable()
        status = {"status": "ok" if reachable else "judge unreachable", "judge": detail,
                  **self._state()}  # fmt: skip
        return web.json_response(status, status=200 if reachable else 503)

    async def _judge_reachable(self) -> tuple[bool, str]:
        """Whether the judge server answers its `/models` (checked at most once a second), asked at the address and
        with the key the judge's own requests use."""
        if self._engine_server is None:
            return True, "in process"
        now = time.monotonic()
        if self._health is not None and now - self._health[0] < 1.0:
            return self._health[1], self._health[2]
        server = self.reward.judge.engine.server
        url = server.base_url
        try:
            async with self._session.get(f"{url}/models", headers=server.headers, timeout=ClientTimeout(total=5)) as answer:
                reachable, detail = answer.status == 200, f"{url} answered {answer.status}"
        except Exception as error:  # any failure to reach it is the answer
            reachable, detail = False, f"{url} cannot be reached: {type(error).__name__}: {error}"
        self._health = (now, reachable, detail)
        return reachable, detail

    async def metrics_page(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    # -- the application -------------------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        started = time.monotonic()
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        try:
            if self.settings.api_key is not None:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.settings.api_key}".encode()):
                    raise BadRequest("missing or wrong API key (send `Authorization: Bearer KEY`)", status=401)
            response = await handler(request)
        except BadRequest as error:
            self.metrics.refused.labels(field=error.field or "body").inc()
            response = web.json_response({"error": str(error), "field": error.field}, status=error.status)
        except (JudgeUnavailable, ServerStopping) as error:
            response = web.json_response({"error": f"{type(error).__name__}: {error}"}, status=503,
                                         headers={"Retry-After": str(self.settings.retry_after)})  # fmt: skip
        except EngineError as error:  # the judge server refused the group's requests as a whole
            response = web.json_response({"error": f"the judge server: {error}"}, status=502)
        except web.HTTPException as error:  # the router's 404 / 405, as JSON
            response = web.json_response({"error": error.reason, "path": request.path}, status=error.status,
                                         headers={k: v for k, v in error.headers.items() if k == "Allow"})  # fmt: skip
        except Exception:
            logger.exception("Unexpected error answering %s %s", request.method, request.path)
            response = web.json_response({"error": "internal error of the reward server (see its log)"}, status=500)
        self.metrics.requests.labels(route=route, status=str(response.status)).inc()
        self.metrics.request_seconds.labels(route=route).observe(time.monotonic() - started)
        return response

    def application(self) -> web.Application:
        # The body limit is ours (`_body`, with a message naming the flag); aiohttp's own stops a chunked body.
        app = web.Application(middlewares=[self._errors], client_max_size=self.settings.max_body_bytes)
        app.router.add_post("/verl", self.verl)
        app.router.add_post("/get_reward", self.openrlhf)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 5000, sock: socket.socket | None = None) -> int:
        """Listen on `host:port` (or on `sock`) with a backlog of `settings.backlog`; returns the port."""
        # aiohttp's keep-alive timer runs from a connection's start (from aiohttp 3.14.4, the floor in pyproject.toml)
        # and from each answer: a client that has not sent a whole request head by then (a slow or silent one) is
        # closed. It is the header timeout.
        self._runner = web.AppRunner(self.application(), access_log=access_logger,
                                     access_log_format=ACCESS_LOG_FORMAT,
                                     keepalive_timeout=self.settings.header_timeout, shutdown_timeout=5.0)  # fmt: skip
        await self._runner.setup()
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self._route_judge_requests_on(loop)
        self._listener = await loop.create_server(self._runner.server, sock=sock, backlog=self.settings.backlog)
        self.port = sock.getsockname()[1]
        self._sweeper = loop.create_task(self._sweep_forever())
        return self.port

    def _route_judge_requests_on(self, loop) -> None:
        """While serving, the judge's requests (an OpenAI-compatible server's) travel on this loop's aiohttp client
        (`LoopServer`): the judging threads only wait, and the CPU a request costs is aiohttp's, not the `openai`
        client's synchronous path (several times more; it was most of the server's CPU per sample)."""
        from aiohttp import TCPConnector

        from trl_longrm.serving.loop_transport import LoopServer
        from trl_longrm.serving.openai_engine import _Server

        engine = getattr(self.reward.judge, "engine", None)
        if not isinstance(getattr(engine, "server", None), _Server):
            return
        # No connection limit of the session's own: the budget bounds the requests in flight.
        self._session = ClientSession(connector=TCPConnector(limit=0))
        self._engine_server = engine.server
        engine.server = LoopServer(engine.server, loop, self._session)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.collector.sweep()

    async def stop(self) -> None:
        """Stop accepting connections, answer what is held (groups being judged get `drain_timeout` seconds; the
        incomplete ones, and those still judging after it, 503), then close."""
        if self._listener is not None:
            self._listener.close()
        late = await self.collector.drain(self.settings.drain_timeout)
        if late:
            logger.warning("%d group(s) still being judged after --drain-timeout: answered 503.", late)
        if self._sweeper is not None:
            self._sweeper.cancel()
        await asyncio.sleep(0.1)  # the woken handlers write their answers
        if self._runner is not None:
            await self._runner.cleanup()
        if self._engine_server is not None:
            engine = self.reward.judge.engine
            engine.server.cancel_all()
            engine.server = self._engine_server
            await self._session.close()
        self.judge.close()
