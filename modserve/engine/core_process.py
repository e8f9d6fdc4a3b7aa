"""An engine-core process: one LLMEngine (with its tensor/pipeline-parallel workers) stepping
in a process of its own, fed by an API server over ZMQ (messages in core_protocol.py).

Started by the server (``modserve.server.engine_process``) as ``python -m
modserve.engine.core_process`` with its launch spec as JSON on stdin. It says Hello, imports
the engine's modules, waits for Start, builds the engine, says Ready, then loops: apply what
came in, step, send what came out: token ids, never text (the API server detokenizes them,
finds the stop strings, and says where one ended a sequence: StopSequence). A thread of its
own sends a Heartbeat every HEARTBEAT_S with how long the running step has run and the stats
last read between steps, so the server can tell a busy engine from a hung or stopped one
without ever waiting on it.

NOTE: the process dies with its server: PR_SET_PDEATHSIG sends it SIGKILL when the server
goes (kill -9 included), and its workers' watchdogs end them once their parent is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

import msgspec
import zmq

from modserve.engine import core_protocol as p

logger = logging.getLogger("modserve.engine")

HEARTBEAT_S = 0.5  # seconds between heartbeats
STATS_EVERY_S = 0.5  # engine.stats() is read between steps at most this often
IDLE_POLL_S = 1.0  # an idle core waits this long for a message before checking its workers' health
COMPILE_POLL_S = 0.02  # ... and this long while grammar compiles it must report are running


class LaunchSpec(msgspec.Struct):
    config_json: str  # the EngineConfig (this data-parallel rank's) as JSON
    dp_rank: int
    inbox: str  # ZMQ address the server PUSHes to
    outbox: str  # ZMQ address the server PULLs from
    beats: str  # ZMQ address of the heartbeats
    parent_pid: int
    # A core on another machine (--headless): inbox, outbox and beats are empty, and come from
    # the API server's answer to its handshake at this tcp:// address (core_handshake.py).
    handshake: str = ""
    fingerprint: dict[str, str] = {}
    ready_timeout: float = 600.0  # seconds to wait for the API server's answer


class EngineCore:
    """The loop of one engine-core process; ``engine`` is touched by this thread only."""

    def __init__(self, engine: Any, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.compiles: dict[int, Future] = {}  # key -> the grammar compiler's Future
        self.step_started: float | None = None  # read by the heartbeat thread
        self.stats: dict[str, Any] = engine.stats()  # replaced whole, never mutated: the heartbeat reads it
        self.stats_time = time.monotonic()
        self._health_checked = time.monotonic()

    def run(self) -> None:
        """Until Shutdown; raises EngineDeadError when a rank is gone."""
        from modserve.engine.engine import EngineDeadError

        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            if not self._drain(timeout=(COMPILE_POLL_S if self.compiles else IDLE_POLL_S) if idle else 0):
                return
            self._report_compiles()
            self._refresh_stats()
            if not engine.has_unfinished_requests():
                if time.monotonic() - self._health_checked >= IDLE_POLL_S:
                    engine.check_health()  # a worker that died between requests is noticed
                    self._health_checked = time.monotonic()
                continue
            self.step_started = time.monotonic()
            try:
                outputs = engine.step()
            except EngineDeadError:
                raise
            except Exception as e:  # one bad step must not take the engine down
                logger.exception("engine step failed; failing the requests in flight")
                self._fail(list(engine.requests), e, "the engine failed")
                continue
            finally:
                self.step_started = None
            if outputs:  # CoreOutputs: the engine was built with detokenize=False
                self._send(p.Outputs(outputs))

    # -- messages in ------------------------------------------------------------------------------
    def _drain(self, timeout: float) -> bool:
        """Apply every message waiting (the first waited for up to ``timeout`` s); False on Shutdown."""
        while self.inbox.poll(int(timeout * 1000)):
            timeout = 0
            message = p.decode_to_core(self.inbox.recv())
            if isinstance(message, p.Shutdown):
                return False
            try:
                self._apply(message)
            except Exception:
                logger.exception("engine-core message %s failed", type(message).__name__)
        return True

    def _apply(self, message: p.ToCore) -> None:
        engine = self.engine
        if isinstance(message, p.Add):
            try:
                engine.add_request(message.request_id, message.prompt_token_ids, p.unpack(message.params),
                                   message.arrival_time, message.priority,
                                   p.unpack(message.lora) if message.lora else None)
            except Exception as e:  # goes to that request alone
                self._fail([message.request_id], e, "the engine refused the request")
        elif isinstance(message, p.Abort):
            for rid in message.request_ids:
                engine.abort_request(rid)
        elif isinstance(message, p.StopSequence):
            self._stop(message)
        elif isinstance(message, p.CompileGrammar):
            self.compiles[message.key] = engine.grammar.submit(p.unpack(message.spec))
        elif isinstance(message, p.StopCompiles):
            engine.grammar.close()
        elif isinstance(message, p.Utility):
            self._send(self._utility(message))

    def _stop(self, message: p.StopSequence) -> None:
        """End a sequence at the stop string the API server found in its text (as the in-process
        engine's _emit does); it may have stepped on since, or ended otherwise meanwhile."""
        engine = self.engine
        req = engine.requests.get(message.request_id)
        if req is None:
            return  # ended already: its blocks are free
        seq = req.seqs[message.index]
        if not seq.is_finished:
            engine.spec.forget(seq)
        engine.scheduler.finish(seq, "stop", message.stop, message.num_output_tokens)
        if req.finished:  # the server showed its end already
            del engine.requests[message.request_id]

    def _utility(self, message: p.Utility) -> p.UtilityDone:
        if message.method not in p.UTILITY_METHODS:
            return p.UtilityDone(message.key, error_kind="other", message=f"no such engine call: {message.method}")
        try:
            return p.UtilityDone(message.key, p.pack(getattr(self.engine, message.method)(*p.unpack(message.args))))
        except ValueError as e:
            return p.UtilityDone(message.key, error_kind="invalid", message=str(e))
        except Exception as e:
            logger.exception("engine call %s failed", message.method)
            return p.UtilityDone(message.key, error_kind="other", message=f"{type(e).__name__}: {e}")

    # -- messages out -----------------------------------------------------------------------------
    def _send(self, message: msgspec.Struct) -> None:
        self.outbox.send(p.encode(message))

    def _fail(self, request_ids: list[str], error: Exception, what: str) -> None:
        from modserve.core.registry import PluginError

        kind = "plugin" if isinstance(error, PluginError) else "engine"
        message = str(error) if kind == "plugin" else f"{what}: {error}"
        for rid in request_ids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("could not abort %s after a failure", rid)
        self._send(p.Outputs([], [p.RequestError(rid, kind, message) for rid in request_ids]))

    def _report_compiles(self) -> None:
        from modserve.core.registry import PluginError
        from modserve.engine.grammar_compile import CompilerClosed

        for key, future in list(self.compiles.items()):
            if not future.done():
                continue
            del self.compiles[key]
            error = future.exception()
            kind = (None if error is None else "invalid" if isinstance(error, ValueError)
                    else "timeout" if isinstance(error, (TimeoutError, FutureTimeout))
                    else "closed" if isinstance(error, CompilerClosed)
                    else "plugin" if isinstance(error, PluginError) else "other")
            self._send(p.GrammarDone(key, kind, "" if error is None else str(error)))

    def _refresh_stats(self) -> None:
        if time.monotonic() - self.stats_time >= STATS_EVERY_S:
            self.stats = self.engine.stats()
            self.stats_time = time.monotonic()

    def heartbeats(self, context: zmq.Context, address: str, stop: threading.Event) -> None:
        """(its own thread and socket) A Heartbeat every HEARTBEAT_S until ``stop``."""
        beats = context.socket(zmq.PUSH)
        beats.setsockopt(zmq.LINGER, 0)
        beats.connect(address)
        try:
            while not stop.wait(HEARTBEAT_S):
                started, now = self.step_started, time.monotonic()
                beats.send(p.encode(p.Heartbeat(0.0 if started is None else now - started, p.pack(self.stats),
                                                now - self.stats_time)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the server is gone or closing: nothing to tell
        finally:
            beats.close()


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent ends (Linux); checked once after, for the race."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=LaunchSpec)
    die_with_parent(spec.parent_pid)
    logging.basicConfig(level=os.environ.get("MODSERVE_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s [engine-core {spec.dp_rank}] %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when the core stops
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where each thread is
    return run_core(spec)


def run_core(spec: LaunchSpec) -> int:
    """Hello, Start, build, Ready, then the loop until Shutdown: the process's exit status. Also
    the body of a Ray actor's core (server/ray_cores.py), which joins by the handshake."""
    context = zmq.Context()
    if spec.handshake:
        from modserve.engine.remote_core import handshake

        joined = handshake(context, spec.handshake, spec.dp_rank, spec.fingerprint, spec.ready_timeout)
        spec = msgspec.structs.replace(spec, inbox=joined.inbox, outbox=joined.outbox, beats=joined.beats)
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    if spec.handshake:  # before connecting: the watch must see the connection made
        from modserve.engine.remote_core import end_with_server, keep_alive

        keep_alive(inbox, outbox)
        end_with_server(inbox, spec.handshake)
    for sock, address in ((inbox, spec.inbox), (outbox, spec.outbox)):
        sock.setsockopt(zmq.LINGER, 2000)  # a last message (Dead, Failed) still goes out
        sock.connect(address)
    outbox.send(p.encode(p.Hello(os.getpid())))
    # The engine's modules (torch, transformers) and the checkpoint's config class import now,
    # while the server finishes its own start and the cores before this one build. What fails here
    # fails again in _build, after Start, which reports it as Failed.
    with contextlib.suppress(Exception):
        import modserve.engine.engine  # noqa: F401
        from modserve.runner.loader import load_hf_config

        load_hf_config(msgspec.json.decode(spec.config_json)["model"])
    if not isinstance(p.decode_to_core(inbox.recv()), p.Start):
        return 1
    try:
        engine = _build(spec.config_json, spec.dp_rank)
    except BaseException as e:
        logger.exception("the engine could not be built")
        outbox.send(p.encode(p.Failed(f"{type(e).__name__}: {e}")))
        return 1
    return _serve(engine, context, inbox, outbox, spec.beats)


def _build(config_json: str, dp_rank: int) -> Any:
    from modserve.core.config import EngineConfig
    from modserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig.model_validate_json(config_json), progress=False, dp_rank=dp_rank, detokenize=False)


def _serve(engine: Any, context: zmq.Context, inbox: zmq.Socket, outbox: zmq.Socket, beats: str) -> int:
    from modserve.engine.engine import EngineDeadError

    core = EngineCore(engine, inbox, outbox)
    outbox.send(p.encode(p.Ready(p.pack(engine.limits), engine.allocator.num_blocks)))
    stop = threading.Event()
    beater = threading.Thread(target=core.heartbeats, args=(context, beats, stop), name="modserve-heartbeat",
                              daemon=True)
    beater.start()
    code = 0
    try:
        core.run()
    except EngineDeadError as e:
        logger.error("engine dead: %s; failing the %d requests in flight", e, len(engine.requests))
        core._send(p.Dead(str(e)))
        code = 1
    finally:
        stop.set()
        beater.join()
        for rid in list(engine.requests):  # stopped with requests in flight: free their blocks
            engine.abort_request(rid)
        engine.shutdown()
        from modserve.engine.remote_core import stop_watching

        stop_watching()  # a remote core's own closing is no lost server
        inbox.close()
        outbox.close()
        context.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
