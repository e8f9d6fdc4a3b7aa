"""What a front end (the HTTP server) needs of an engine that runs elsewhere.

The engine steps in processes of its own (or a thread, or N replicas of either); a client hands it prompts,
reads their outputs as they come, and checks requests against the engine's limits before
they go. Implemented by ``modserve.server.engine_process.EngineProcess`` (an engine-core
process), ``modserve.server.async_engine.AsyncEngine`` (an engine in a thread) and
``modserve.server.replicas.ReplicaSet`` (data-parallel replicas served as one).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

from modserve.core.config import EngineConfig
from modserve.core.lora_request import LoRARequest
from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.core.structured_outputs import GrammarSpec
from modserve.engine.grammar_compile import CompiledGrammar
from modserve.engine.limits import EngineLimits


class OutputStream(Protocol):
    """The outputs of the requests one ``submit`` made: iterating yields each request's
    latest cumulative RequestOutput as it comes; a request that fails raises its error."""

    request_ids: list[str]  # one per prompt, in the prompts' order

    def index(self, request_id: str) -> int:
        """The position of ``request_id``'s prompt among those submitted."""

    def close(self) -> None:
        """Abort whatever has not finished; safe to call twice."""

    def __aiter__(self) -> OutputStream: ...

    async def __anext__(self) -> RequestOutput: ...


class EngineClient(Protocol):
    """Called on one event loop's thread (``shutdown_engine`` once that loop has ended); no
    call waits for the engine's step."""

    limits: EngineLimits  # fixed at start-up, so any thread may read it
    config: EngineConfig  # the engine's (data-parallel rank 0's): what the server reads of it
    observer: Any  # told about every request's end (the server's metrics); set before start()

    def start(self) -> None:
        """Start the engine thread(s), answering on the running event loop."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread(s); the engine frees what the requests left in it held."""

    def shutdown_engine(self) -> None:
        """Stop the engine's tensor-parallel workers, after ``stop()`` (the server's last act)."""

    @property
    def alive(self) -> bool:
        """The engine takes requests (with replicas: every one's thread runs)."""

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died (a worker failed), else None: stopped is not dead."""

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have not produced their first token yet."""

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended."""

    def submit(self, prompts: list[list[int]], params: SamplingParams, arrival_time: float | None = None,
               priority: int = 0, lora_request: LoRARequest | None = None) -> OutputStream:
        """One request per prompt, all answered through one stream; raises the implementation's
        EngineDead when no engine runs to take them. The caller has checked them against ``limits``."""

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request that has not finished (else nothing happens); ``reason`` is what the
        request observer counts it as."""

    def cancel_all(self, error: Exception) -> None:
        """End every request in flight: each stream's reader raises ``error``."""

    async def stats(self) -> dict[str, Any]:
        """The engine's counters and gauges, read between its steps (the last ones once it stopped)."""

    def compile_grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar | None]:
        """Compile a request's constraint on the engine's grammar workers (cached); the Future's
        exception is a ValueError saying why the spec was refused (its result, for an engine in
        another process, is None: the engine finds the compiled grammar in its own cache)."""

    async def call_utility(self, method: str, *args: Any) -> Any:
        """``engine.<method>(*args)`` run between the engine's steps (``embed``: the pooling
        runner's), its result or its exception (a ValueError stays one)."""

    def stop_compiles(self) -> None:
        """Kill the compiles ``compile_grammar`` started: their Futures fail with CompilerClosed."""
