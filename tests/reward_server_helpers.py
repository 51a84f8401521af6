"""The reward server for tests: run in a thread of the test process (`ServerThread`) or as the command users run
(`server_process`), judged by the stand-in judge (`tests/judge_stand_in.py`), with plain-socket and aiohttp clients."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import aiohttp


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def raise_fd_limit(wanted: int = 16384) -> int:
    """Raise this process's open-file limit towards `wanted` (up to the hard limit), as the server raises its own;
    returns the soft limit now."""
    from trl_longrm.rewards.server.main import raise_open_file_limit

    return raise_open_file_limit(wanted)


def require_fds(needed: int) -> None:
    """Skip, naming the limit, where this process cannot open `needed` files even after raising its soft limit to the
    hard one (`ulimit -Hn`): every connection of the test is a descriptor on each side."""
    import pytest

    limit = raise_fd_limit(max(needed, 16384))
    if limit < needed:
        pytest.skip(f"this test holds {needed} descriptors at once; the open-file hard limit here is {limit} (ulimit -Hn)")


class ServerThread:
    """A `RewardServer` on its own event loop in a thread; `url` is its root."""

    def __init__(self, reward, settings):
        from trl_longrm.rewards.server.app import RewardServer

        self.server = RewardServer(reward, settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="reward-server")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def call(self, coroutine, timeout=60):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        self.call(self.server.start("127.0.0.1", 0))
        return self

    def __exit__(self, *exc) -> None:
        self.call(self.server.stop(), timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@contextmanager
def server_process(judge_url: str, tokenizer_dir: str, *flags: str, env=None, log_path=None):
    """`python -m trl_longrm reward-server` as users start it; yields (process, url, log path)."""
    from trl_longrm.serving.server import free_port

    port = free_port()
    log_path = Path(log_path or f"/tmp/reward-server-{port}.log")
    command = [sys.executable, "-m", "trl_longrm", "reward-server", "--base-url", judge_url, "--served-model", "judge",
               "--tokenizer", tokenizer_dir, "--max-length", "4096", "--max-new-tokens", "16", "--port", str(port),
               *flags]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise AssertionError(f"the reward server exited {process.returncode}:\n{log_path.read_text()[-3000:]}")
        if "Reward server on" in log_path.read_text():
            break
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the reward server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    try:
        yield process, url, log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


@contextmanager
def judge_process(tokenizer_dir: str, latency: float = 0.0, port: int = 0):
    """The stand-in judge as a process of its own (so that a test can kill it: an outage); yields its base URL."""
    process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "judge_stand_in.py"), "--tokenizer",
                                tokenizer_dir, "--port", str(port), "--latency", str(latency)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    line = process.stdout.readline()
    if not line.startswith("READY "):
        process.kill()
        raise AssertionError(f"the stand-in judge did not start: {line!r}")
    try:
        yield f"http://127.0.0.1:{int(line.split()[1])}/v1", process
    finally:
        process.kill()
        process.wait(30)


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data` as it is on a new connection; what the server answers before closing (or within `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return b"".join(chunks)


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


def body_of(answer: bytes) -> dict:
    """The answer's JSON body; a malformed request (refused by aiohttp's HTTP parser, before our code) is answered
    in plain text, given here as `{"error": text}`."""
    body = answer.partition(b"\r\n\r\n")[2]
    try:
        return json.loads(body or b"{}")
    except json.JSONDecodeError:
        return {"error": body.decode(errors="replace")}


async def post_each(url: str, payloads: list[dict], headers=None, timeout=None) -> list[tuple[int, dict]]:
    """Every payload posted at once, a new connection for each (as verl's and OpenRLHF's clients post)."""

    async def one(payload):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.post(url, json=payload, headers=headers) as answer:
                return answer.status, await answer.json(content_type=None)

    return await asyncio.gather(*(one(p) for p in payloads))
