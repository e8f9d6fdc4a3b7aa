"""Run an app under uvicorn: a banner once it listens, a deadline for each request's
headers, and on SIGTERM/SIGINT a drain of the requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Any, Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from modserve.core.config import EngineConfig
from modserve.server.async_engine import ShuttingDown
from modserve.server.serving import ServerState

logger = logging.getLogger("modserve.server")
# Streams cut at the drain timeout still send their error event and [DONE]: this long.
FLUSH_SECONDS = 5.0
ENGINE_WATCH_S = 0.2  # how often the server looks whether its engine died


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than
    ``header_timeout`` (a slowloris client dribbling a header a minute holds nothing)."""

    header_timeout: float = 30.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers are in: the body has its own deadline (limits.py)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # a kept-alive connection's next request gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server with a banner, a drain on shutdown, and exit status 0 after it; or,
    once the engine died (``exit_on_engine_death``), a drain of what still runs and status 1."""

    def __init__(self, config: uvicorn.Config, banner: str, state: ServerState, shutdown_timeout: float,
                 exit_on_engine_death: bool = True) -> None:
        super().__init__(config)
        self.banner = banner
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.exit_on_engine_death = exit_on_engine_death
        self.exit_code = 0

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)
            if self.exit_on_engine_death:
                self._watch = asyncio.create_task(self._exit_once_engine_dies())

    async def _exit_once_engine_dies(self) -> None:
        engine = self.state.engine
        while engine.dead_reason is None and not self.should_exit:
            await asyncio.sleep(ENGINE_WATCH_S)
        if engine.dead_reason is None or self.should_exit:
            return
        logger.error("the engine died (%s): draining the requests still running, then exiting with status 1 "
                     "(exit_on_engine_death)", engine.dead_reason)
        # Still listening while the other replicas finish: /health says 503, /metrics answers,
        # new requests get a 503.
        self.state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while engine.num_in_flight and loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(ENGINE_WATCH_S)
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        # uvicorn closes the listener at once and then waits for open connections;
        # meanwhile the drain ends whatever is still running at the timeout.
        self.state.draining = True
        drain = asyncio.create_task(self._drain())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    async def _drain(self) -> None:
        engine, state = self.state.engine, self.state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        if engine.num_in_flight:
            logger.info("draining %d requests (shutdown_timeout=%g s)", engine.num_in_flight, self.shutdown_timeout)
        while (engine.num_in_flight or state.compiles_in_flight) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if state.compiles_in_flight:  # a compile may run far past the deadline: its worker is killed
            logger.warning("shutdown_timeout reached: stopping %d grammar compiles", state.compiles_in_flight)
            await asyncio.to_thread(state.stop_compiles)
        if engine.num_in_flight:
            logger.warning("shutdown_timeout reached: ending %d requests with an error", engine.num_in_flight)
            engine.cancel_all(ShuttingDown("shutdown_timeout reached"))

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own re-raises the signal after a graceful shutdown, so the process
        # would end "killed by SIGTERM"; a drained server exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run(app: FastAPI, host: str, port: int, log_level: str, api_key: str | None, config: EngineConfig,
        access_log: bool = True) -> int:
    """Serve until told to stop; the process's exit status (1 once the engine died)."""
    protocol = type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                    {"header_timeout": config.request_read_timeout})
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), http=protocol,
                               access_log=access_log,
                               timeout_graceful_shutdown=int(config.shutdown_timeout + FLUSH_SECONDS) + 1)
    state: ServerState = app.state.server
    server = Server(uv_config, banner(host, port, state.model_name, api_key), state, config.shutdown_timeout,
                    config.exit_on_engine_death)
    server.run()
    return server.exit_code


def banner(host: str, port: int, model: str, api_key: str | None) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://{host}:{port}"
    # The key itself is never printed: logs are read by more people than hold it.
    auth = " -H \"Authorization: Bearer $MODSERVE_API_KEY\"" if api_key else ""
    key = "os.environ['MODSERVE_API_KEY']" if api_key else "'none'"
    note = "An API key is set: send it as 'Authorization: Bearer <key>'.\n" if api_key else ""
    return (
        f"\nmodserve is serving {model!r} at {base}/v1 (Ctrl-C stops it). {note}Try:\n"
        f"  curl {base}/v1/completions{auth} -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
        f"  python -c \"import os; from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key={key}); "
        f"print(c.chat.completions.create(model='{model}', max_tokens=16, "
        f"messages=[{{'role': 'user', 'content': 'Hello'}}]).choices[0].message.content)\"\n"
    )
