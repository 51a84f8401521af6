"""An OpenAI-compatible server reached through an aiohttp session on an event loop that runs in another thread: the
engine's requests are made on that loop (aiohttp's C-accelerated client, pooled keep-alive connections) while the
calling threads only wait, so that a process already serving on an event loop (the reward server) spends a fraction
of the CPU per judge request that the `openai` client's synchronous path costs, and the requests of many threads
share one connection pool.

The engine above it is unchanged (`OpenAIGenerator` builds the same payloads and reads the same answers); only how a
request travels changes, with the `openai` client's rules: a dropped connection, a timeout, a 408/409/429 or a 5xx
tried again with exponential backoff and jitter (the server's `Retry-After` when it gives one), `max_retries` times;
then the same errors as `_Server.request` raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import threading

from trl_longrm.serving.openai_engine import _HTTPRefusal, _Server


_RETRIED = (408, 409, 429)


class LoopServer(_Server):
    """`server` (an engine's `_Server`) with its requests made on `loop` through `session` (an
    `aiohttp.ClientSession` of that loop). Made where the loop runs; `request` is called from other threads.

    Example:
    ```python
    >>> # on the event loop's thread:
    >>> engine.server = LoopServer(engine.server, asyncio.get_running_loop(), aiohttp.ClientSession())
    ```
    """

    def __init__(self, server: _Server, loop: asyncio.AbstractEventLoop, session):
        # Not `_Server.__init__`: the `openai` client is not needed here, only the server's address and rules.
        self.base_url, self.root = server.base_url, server.root
        self.timeout, self.max_retries = server.timeout, server.max_retries
        key = getattr(getattr(server, "_client", None), "api_key", None)
        self.headers = {"Authorization": f"Bearer {key}"} if key and key != "EMPTY" else {}
        self.loop, self.session = loop, session
        self._pending: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()

    def request(self, url: str, payload: dict | None = None) -> dict:
        future = asyncio.run_coroutine_threadsafe(self._request(url, payload), self.loop)
        with self._lock:
            self._pending.add(future)
        try:
            # Bounded: every try is bounded by the timeout, the waits between tries by their backoff.
            return future.result(timeout=(self.timeout + 10.0) * (self.max_retries + 1) + 60.0)
        except concurrent.futures.CancelledError:
            raise self.unreachable("the client stopped") from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self.timed_out(url) from None
        finally:
            with self._lock:
                self._pending.discard(future)

    def cancel_all(self) -> None:
        """Cancel the requests in flight (the loop is stopping): their callers get `EngineUnavailable`."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.cancel()

    async def _request(self, url: str, payload: dict | None) -> dict:
        import aiohttp

        method = "GET" if payload is None else "POST"
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            wait = min(0.5 * 2**attempt, 8.0) * (1 - 0.25 * random.random())
            try:
                async with self.session.request(method, url, json=payload, headers=self.headers,
                                                timeout=timeout) as answer:  # fmt: skip
                    text = await answer.text()
                    if answer.status < 400:
                        return json.loads(text)
                    if last or not (answer.status in _RETRIED or answer.status >= 500):
                        raise _HTTPRefusal(url, answer.status, text)
                    after = answer.headers.get("Retry-After", "")
                    wait = float(after) if after.replace(".", "", 1).isdigit() and float(after) <= 60 else wait
            except asyncio.TimeoutError:
                if last:
                    raise self.timed_out(url) from None
            except aiohttp.ClientConnectionError as error:
                if last:
                    raise self.unreachable(error) from None
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover - the last try returns or raises
