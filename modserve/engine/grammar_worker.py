"""The grammar compile processes' side (see :mod:`modserve.engine.grammar_processes`).

The template process imports the backends' libraries and builds the backends once, then
forks a worker whenever the engine asks: a worker is ready in milliseconds, and shares the
template's memory until it writes. Each worker caps its address space, then compiles one
spec at a time and answers with the backend's ``serialize`` bytes.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from modserve.core.config import PluginChoice
from modserve.engine.grammar_compile import compile_spec, out_of_memory
from modserve.core.plugin_calls import broke, calling, described
from modserve.core.registry import PluginError, Registration


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What the template builds its backends from: per name, the registration and choice, or
    why that backend cannot be made outside the engine's process."""

    backends: dict[str, tuple[Registration, PluginChoice] | str]
    vocab: Any  # GrammarVocab
    memory_mb: int
    single: bool  # one backend named: its refusal is the whole message


def template_main(fd: int) -> None:
    """The template's life on the pipe ``fd`` to the engine: ("fork",) answers a worker's pid
    and its end of a new pipe; ("reap", pid) that killed worker's exit code. Ends at EOF."""
    conn = Connection(fd)
    sys.path[:] = conn.recv()  # first: where the registrations' classes import from
    setup: WorkerSetup = conn.recv()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the engine's to handle
    backends = {name: _made(made_by, setup.vocab) for name, made_by in setup.backends.items()}
    conn.send(("ready",))
    parent = os.getppid()
    while True:
        # NOTE: no thread watches the parent here: a fork copies only the calling thread
        if not conn.poll(0.5):
            if os.getppid() != parent:
                os._exit(1)
            continue
        try:
            request = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if request[0] == "reap":
            conn.send(os.waitstatus_to_exitcode(os.waitpid(request[1], 0)[1]))
            continue
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            conn.close()
            ours.close()
            _worker(Connection(theirs.detach()), backends, setup)
        theirs.close()
        conn.send(pid)
        send_handle(conn, ours.fileno(), pid)
        ours.close()


def _made(made_by: tuple[Registration, PluginChoice] | str, vocab: Any) -> Any:
    if isinstance(made_by, str):
        return PluginError(made_by)
    reg, choice = made_by
    try:
        return reg.create(choice.options, vocab)
    except Exception as e:  # remembered: auto then skips it with this reason
        return e


def _worker(conn: Connection, backends: dict[str, Any], setup: WorkerSetup) -> None:
    """A forked worker: compile what arrives until EOF; never returns into the template's loop."""
    try:
        _exit_with_parent()
        _cap_memory(setup.memory_mb)
        conn.send(("ready",))
        while True:
            try:
                spec, names = conn.recv()
            except (EOFError, OSError):
                return
            reply = _compiled(spec, names, backends, setup.single)
            conn.send(reply)
            if reply[0] == "memory":
                return  # whatever the backend held is not worth keeping: the engine forks another
    finally:
        os._exit(0)


def _compiled(spec: Any, names: list[str], backends: dict[str, Any], single: bool) -> tuple:
    try:
        grammar = compile_spec(spec, names, backends.__getitem__, single)
        with calling(grammar.backend, "grammar_backend", "serialize()"):
            data = grammar.backend.serialize(grammar.compiled)
        if not isinstance(data, bytes):
            raise broke(grammar.backend, "grammar_backend", "serialize()", "bytes", described(data))
        return ("ok", grammar.backend_name, data, grammar.compile_seconds)
    except Exception as e:  # the message only, as the chained cause may not pickle
        if out_of_memory(e):
            return ("memory",)
        if isinstance(e, (ValueError, PluginError)):
            return ("error", type(e)(str(e)))
        return ("error", RuntimeError(f"{type(e).__name__}: {e}"))


def _cap_memory(memory_mb: int) -> None:
    """Address space: what the imports took plus ``memory_mb`` (a compile past it fails to allocate)."""
    try:
        import resource

        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (ImportError, OSError, StopIteration):  # not Linux: no cap
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = vm + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _exit_with_parent() -> None:
    """End this worker when the template is gone, even in the middle of a compile."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="modserve-grammar-parent-watch", daemon=True).start()
