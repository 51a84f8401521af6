"""`trl-longrm reward-server` (also `python -m trl_longrm.rewards.server`): its flags, and the process that serves
until SIGTERM or SIGINT, then drains (`RewardServer.stop`) and exits 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys


API_KEY_ENV = "TRL_LONGRM_REWARD_SERVER_API_KEY"


def add_reward_server_arguments(parser: argparse.ArgumentParser) -> None:
    judge = parser.add_argument_group("the judge")
    judge.add_argument("--base-url", required=True, help="The judge server's OpenAI-compatible base URL (…/v1).")
    judge.add_argument("--served-model", default=None, help="The served judge's name (default: the only one).")
    judge.add_argument("--tokenizer", required=True, help="The judge checkpoint's path, for its tokenizer.")
    judge.add_argument("--protocol", default="pairwise", choices=["pairwise", "ranking", "pointwise"])
    judge.add_argument("--template", default=None, help="A prompt template YAML file (default: the built-in).")
    judge.add_argument("--max-length", type=int, default=131072, help="The judge's context (cut to the server's).")
    judge.add_argument("--max-new-tokens", type=int, default=2048, help="The longest judgment.")
    judge.add_argument("--no-verdict-probs", dest="verdict_probs", action="store_false",
                       help="Pointwise: reward the parsed score, not the expected one.")  # fmt: skip
    judge.add_argument("--max-concurrency", type=int, default=64,
                       help="Requests in flight to the judge server, for the whole reward server (groups wait for "
                       "room: backpressure).")  # fmt: skip
    judge.add_argument("--request-timeout", type=float, default=600.0, help="Seconds per judge request.")
    judge.add_argument("--judge-timeout", type=float, default=1800.0,
                       help="Seconds a group's judging may take from its start; past it (a hung judge) its requests "
                       "are answered 503.")  # fmt: skip
    groups = parser.add_argument_group("groups")
    groups.add_argument("--group-size", type=int, required=True,
                        help="Samples per prompt: OpenRLHF's --rollout.n_samples_per_prompt, verl's rollout.n.")
    groups.add_argument("--group-timeout", type=float, default=600.0,
                        help="Seconds after a group's first sample before it is judged with what arrived.")
    groups.add_argument("--max-group-size", type=int, default=1024, help="The largest group_size a request may send.")
    groups.add_argument("--keep-answers", type=float, default=900.0,
                        help="Seconds an answer whose client went is kept for its retry.")
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="The address to listen on (loopback by default).")
    http.add_argument("--port", type=int, default=5000)
    http.add_argument("--backlog", type=int, default=4096,
                      help="Connections the kernel queues before they are accepted (capped by net.core.somaxconn).")
    http.add_argument("--max-body-bytes", type=int, default=16 * 2**20, help="The largest request body (413 past it).")
    http.add_argument("--header-timeout", type=float, default=60.0,
                      help="Seconds a connection has to send a request's head (at its start, and after each answer).")
    http.add_argument("--read-timeout", type=float, default=60.0, help="Seconds a request has to send its body (408).")
    http.add_argument("--retry-after", type=int, default=5,
                      help="The Retry-After of a 503 (judge unavailable, server stopping).")
    http.add_argument("--drain-timeout", type=float, default=60.0,
                      help="On SIGTERM: seconds the groups being judged get to finish before they are answered 503.")
    http.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                      help=f"Require `Authorization: Bearer KEY` on every request (default: ${API_KEY_ENV}).")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="info logs a line per request (the access log).")


def settings_from(args: argparse.Namespace):
    from trl_longrm.rewards.server.app import ServerSettings

    numbers = {"--group-size": args.group_size, "--max-concurrency": args.max_concurrency,
               "--max-group-size": args.max_group_size, "--max-body-bytes": args.max_body_bytes,
               "--backlog": args.backlog}  # fmt: skip
    for flag, value in numbers.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}.")
    if args.group_size > args.max_group_size:
        raise ValueError(f"--group-size {args.group_size} is over --max-group-size {args.max_group_size}.")
    times = {"--group-timeout": args.group_timeout, "--judge-timeout": args.judge_timeout,
             "--request-timeout": args.request_timeout, "--header-timeout": args.header_timeout,
             "--read-timeout": args.read_timeout, "--keep-answers": args.keep_answers}  # fmt: skip
    for flag, value in times.items():
        if not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value}.")
    if args.drain_timeout < 0 or args.retry_after < 0:
        raise ValueError("--drain-timeout and --retry-after must be >= 0.")
    return ServerSettings(
        group_size=args.group_size, group_timeout=args.group_timeout, judge_timeout=args.judge_timeout,
        max_concurrency=args.max_concurrency, max_group_size=args.max_group_size, max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout, read_timeout=args.read_timeout, retry_after=args.retry_after,
        drain_timeout=args.drain_timeout, keep_answers=args.keep_answers, backlog=args.backlog,
        api_key=args.api_key or None,
    )  # fmt: skip


class _MalformedRequests(logging.Filter):
    """aiohttp logs a request its HTTP parser refuses (a bad Content-Length, a broken head) with a traceback at ERROR;
    it is the client's mistake, answered 400: one line at WARNING says so."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.msg, record.args = "%s (answered %d): %s", (record.getMessage(), error.code, error.message)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _configure_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_MalformedRequests())
    logging.getLogger("trl_longrm").setLevel(level.upper())
    # The judge client logs each of its own requests at INFO: the access log is the reward server's.
    for name in ("httpx", "httpx2", "openai", "aiohttp.access"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))


def raise_open_file_limit(wanted: int = 65536) -> int:
    """Raise this process's soft limit on open files towards `wanted` (capped by the hard limit), as vLLM's server
    does: every held sample is an open connection. Returns the limit now; a warning says when it is low."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < 8192:
        logging.getLogger("trl_longrm.reward_server").warning(
            "This process may open %d files (ulimit -n, hard limit %s): each held sample is a connection, so at most "
            "about %d samples can be held at once. Raise the hard limit (ulimit -Hn) for larger batches.",
            soft, hard, soft - 64,
        )  # fmt: skip
    return soft


async def serve(reward, settings, host: str, port: int, ready=None) -> int:
    """Serve until SIGTERM / SIGINT, then drain and return 0. `ready(port)` is called once listening."""
    from trl_longrm.rewards.server.app import RewardServer

    server = RewardServer(reward, settings)
    bound = await server.start(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if ready is not None:
        ready(bound)
    await stop.wait()
    logging.getLogger("trl_longrm.reward_server").warning(
        "Stopping: no new connections; held groups judged within --drain-timeout %g s or answered 503.",
        settings.drain_timeout,
    )  # fmt: skip
    await server.stop()
    return 0


def run_reward_server(args: argparse.Namespace) -> int:
    from trl_longrm.rewards.judge import JudgeReward
    from trl_longrm.serving.base import EngineError

    _configure_logging(args.log_level)
    raise_open_file_limit()
    try:
        settings = settings_from(args)
    except ValueError as error:
        print(f"trl-longrm reward-server: error: {error}", file=sys.stderr)
        return 2
    try:
        reward = JudgeReward(args.base_url, args.tokenizer, model=args.served_model, protocol=args.protocol,
                             template=args.template, max_length=args.max_length, max_new_tokens=args.max_new_tokens,
                             verdict_probs=args.verdict_probs, max_concurrency=args.max_concurrency,
                             timeout=args.request_timeout, across_processes=False)  # fmt: skip
    except (EngineError, OSError, ValueError) as error:
        print(f"trl-longrm reward-server: error: {error}", file=sys.stderr)
        return 2

    def ready(port: int) -> None:
        print(f"Reward server on http://{args.host}:{port} (groups of {args.group_size}, {args.protocol} judge at "
              f"{args.base_url}, {args.max_concurrency} judge requests in flight at most)", file=sys.stderr,
              flush=True)  # fmt: skip

    try:
        return asyncio.run(serve(reward, settings, args.host, args.port, ready))
    except OSError as error:  # the port is taken, the address not ours
        print(f"trl-longrm reward-server: error: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-longrm reward-server")
    add_reward_server_arguments(parser)
    return run_reward_server(parser.parse_args(argv))
