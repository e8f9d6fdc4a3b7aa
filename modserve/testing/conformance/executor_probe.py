"""A module plugin the executor kit registers while it starts an engine, to see its workers.

Its sampler is the built-in default under another name (tokens do not change). Every rank
builds the engine's sampler, so every rank's process makes one; each leaves a file named
after its process id in ``$MODSERVE_CONFORMANCE_PIDS`` (holding its host name). The
variable is a ``MODSERVE_`` one, which the driver hands its workers (``WorkerSpec.env``),
and the module is registered with ``Registry.add_plugin(module)``, which workers import
again by name: so the kit finds each worker's process whatever the executor (spawned
processes, Ray actors, ...) without knowing how it starts them.

With ``$MODSERVE_CONFORMANCE_LINGER`` set, a worker (a process other than
``$MODSERVE_CONFORMANCE_DRIVER``) also starts a thread that is not a daemon and sleeps
for an hour: the process does not exit by itself once ``run_worker`` returns, as when a
plugin leaves such a thread behind, and the executor's ``shutdown()`` has to end it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from modserve.api import Register, hookimpl
from modserve.samplers.default import DefaultSampler

NAME = "conformance_pid_probe"
PIDS = "MODSERVE_CONFORMANCE_PIDS"
LINGER = "MODSERVE_CONFORMANCE_LINGER"
DRIVER = "MODSERVE_CONFORMANCE_DRIVER"


class PidProbeSampler(DefaultSampler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if folder := os.environ.get(PIDS):
            (Path(folder) / str(os.getpid())).write_text(socket.gethostname())
        if os.environ.get(LINGER) and os.environ.get(DRIVER) != str(os.getpid()):
            threading.Thread(target=time.sleep, args=(3600,), name="modserve-conformance-linger",
                             daemon=False).start()


@hookimpl
def register_samplers(register: Register) -> None:
    register(NAME, f"{__name__}:PidProbeSampler",
             description="conformance kit: the default sampler, noting each rank's process id")
