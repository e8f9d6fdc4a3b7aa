"""Real `modserve serve` processes on 127.0.0.1 for end-to-end tests: launch, wait, read, stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample in /metrics by name (labels folded into the name)."""
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def load(self) -> int:
        """Requests in flight: accepted and not ended (vLLM's ``/load``)."""
        return httpx.get(f"{self.url}/load").json()["server_load"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp: Path, name: str, *flags: str, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "modserve", "--log-level", "info", "serve", "--port", str(port), *flags]
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return Server(proc, f"http://127.0.0.1:{port}", log)


def wait_healthy(server: Server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited ({server.proc.returncode}):\n{server.log.read_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    dump_stacks(server)
    raise TimeoutError(f"server not healthy after {timeout} s (its threads' stacks at the end):\n"
                       f"{server.log.read_text()}")


def dump_stacks(server: Server) -> None:
    """Every thread's stack of the server and of its engine cores, into its log: they print them
    on SIGUSR1 (faulthandler). Other processes it started (workers) are left alone: SIGUSR1
    would end them."""
    try:
        procs = [psutil.Process(server.proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.cmdline()[1:3] in (["-m", "modserve"], ["-m", "modserve.engine.core_process"]):
                proc.send_signal(signal.SIGUSR1)
                time.sleep(0.5)  # one at a time: they write to the same log


def launch_healthy(tmp: Path, name: str, *flags: str, timeout: float = 120,
                   env: dict[str, str] | None = None) -> Server:
    """``launch`` then ``wait_healthy``; a server that does not come up is stopped."""
    server = launch(tmp, name, *flags, env=env)
    try:
        wait_healthy(server, timeout)
    except BaseException:
        stop(server)
        raise
    return server


def stop(server: Server) -> int:
    return stop_all(server)[0]


def stop_all(*servers: Server) -> list[int]:
    """Each server's exit code after SIGTERM (SIGKILL past 20 s), their shutdowns overlapping (a
    server takes seconds to stop): every one is signalled before any is waited for, and once
    only (uvicorn takes a second SIGTERM as "exit now")."""
    for server in servers:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
    codes = []
    for server in servers:
        try:
            codes.append(server.proc.wait(timeout=20))
        except subprocess.TimeoutExpired:
            server.proc.kill()
            codes.append(server.proc.wait())
    return codes


@contextlib.contextmanager
def serving(tmp: Path, name: str, *flags: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A healthy server for the ``with`` block; stopped after it, whatever happened."""
    server = launch(tmp, name, *flags, env=env)
    try:
        wait_healthy(server)
        yield server
    finally:
        stop(server)


@contextlib.contextmanager
def serving_together(tmp: Path, *servers: tuple[str, list[str]]) -> Iterator[list[Server]]:
    """Servers ``(name, flags)`` started at once (their starts overlap), each healthy, for the
    ``with`` block; all stopped after it, whatever happened."""
    started: list[Server] = []
    try:
        for name, flags in servers:
            started.append(launch(tmp, name, *flags))
        for server in started:
            wait_healthy(server)
        yield started
    finally:
        stop_all(*started)


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
