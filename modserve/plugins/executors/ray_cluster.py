"""A local Ray cluster that dies with the process that started it, ``kill -9`` included.

``ray.init(address="local")`` in the server itself starts the GCS, the raylet and their helpers
as its children; Ray makes the GCS and the raylet die with it (PR_SET_PDEATHSIG), and the raylet's
agents (DashboardAgent, RuntimeEnvAgent) notice the raylet's death through their stdin pipe, but
then try to report it through the GCS, which died at the same moment, and stay behind, orphaned,
for a minute or more. The server cannot clean up after a SIGKILL, so a supervisor does:

    python -m modserve.plugins.executors.ray_cluster NUM_CPUS

runs ``ray start --head --block`` and prints the cluster's address once it started, then waits
for its stdin to close (the server stopped the cluster, or died) or its parent to change. It
is a child subreaper (PR_SET_CHILD_SUBREAPER): every process of the cluster, orphaned agents
too, ends up its child, so it can SIGTERM, then SIGKILL, them all and reap them before it exits.
The server only connects (``ray.init(address=...)``).

NOTE: the raylet waits only 15 s for its agents to report their ports and aborts after, which
a loaded machine misses (an agent's imports alone take longer). So the ports are given (free
ones); the dashboard agent's listen port, which ``ray start`` does not pass on to the raylet
(Ray 2.60), is written for it where the raylet looks (Ray's own ``persist_port``, as the agent
itself does later with the same value); and a failed start is tried again.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36
START_TIMEOUT_S = 180.0
TERM_GRACE_S = 5.0  # after SIGTERM, the cluster's processes are SIGKILLed
POLL_S = 0.5
START_TRIES = 3  # a start Ray aborts all the same (a raylet lost to load) is tried again
ADDRESS = re.compile(r"--address='([^']+)'")  # in ray start's "Next steps"


class LocalCluster:
    """The supervisor process of a local Ray cluster, seen from the process that started it
    (which then joins it with ``ray.init(address=cluster.address)``)."""

    def __init__(self, num_cpus: int | None, timeout: float = START_TIMEOUT_S) -> None:
        if "RAY_AUTH_MODE" not in os.environ:  # as a new local cluster of ray.init: a token, this cluster's own
            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
            if "ray._raylet" in sys.modules:  # Ray read its config at import: it must see the mode set here
                sys.modules["ray._raylet"].Config.initialize("")
        # A session of its own: a terminal's Ctrl-C reaches the server, which then stops the cluster.
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(num_cpus or 0)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        self.address = self.proc.stdout.readline().decode().strip() if ready else ""  # type: ignore[union-attr]
        if not self.address:
            self.stop()
            raise RuntimeError(f"a local Ray cluster did not start in {timeout:g} s (ray start's log above says why)")

    def stop(self, timeout: float = 30.0) -> None:
        """Close the supervisor's stdin (it stops the cluster) and wait for it; SIGKILL after ``timeout``."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        for child in _children(frontier.pop()):
            found.append(child)
            frontier.append(child)
    return found


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _end_all() -> None:
    """SIGTERM every descendant, SIGKILL what is left after TERM_GRACE_S, until none is left."""
    deadline = time.monotonic() + TERM_GRACE_S
    sig = signal.SIGTERM
    while pids := _descendants(os.getpid()):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
        _reap()
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
    _reap()


def _wait_for_the_end(parent: int) -> None:
    """Until stdin closes (or says anything) or the parent is gone."""
    while os.getppid() == parent:
        if select.select([sys.stdin], [], [], POLL_S)[0]:
            return


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.bind(("", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def _ray_start(num_cpus: int) -> tuple[subprocess.Popen, str]:
    """``ray start --head --block`` and the address it printed (empty: it ended first)."""
    gcs, listen, grpc, runtime_env, metrics = _free_ports(5)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
           "--include-dashboard=false", f"--port={gcs}", f"--dashboard-agent-listen-port={listen}",
           f"--dashboard-agent-grpc-port={grpc}", f"--runtime-env-agent-port={runtime_env}",
           f"--metrics-export-port={metrics}"] + ([f"--num-cpus={num_cpus}"] if num_cpus else [])
    # NOTE: ray start drains its node on SIGTERM (for a Serve deployment's proxies) until the
    # raylet goes; this cluster serves one server, which has stopped by then: nothing to drain.
    env = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **os.environ}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    threading.Thread(target=_tell_the_raylet, args=(proc.pid, listen), daemon=True).start()
    for line in proc.stdout:  # type: ignore[union-attr]
        sys.stderr.write(line)
        if found := ADDRESS.search(line):
            return proc, found.group(1)
    return proc, ""


def _tell_the_raylet(ray_start: int, listen_port: int) -> None:
    """Once the raylet runs (below ``ray_start``), persist the dashboard agent's listen port it waits for."""
    from ray._raylet import DASHBOARD_AGENT_LISTEN_PORT_NAME, persist_port

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for pid in _descendants(ray_start):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
            if args[0].endswith("/raylet") and "node_id" in flags and "session_dir" in flags:
                persist_port(flags["session_dir"], flags["node_id"], DASHBOARD_AGENT_LISTEN_PORT_NAME, listen_port)
                return
        time.sleep(0.1)


def main() -> int:
    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for _ in range(START_TRIES):
            proc, address = _ray_start(int(sys.argv[1]))
            if address:
                break
            _end_all()  # what the failed try left
        else:
            return 1
        print(address, flush=True)
        # its later lines still go to the server's log (a closed pipe would end it)
        threading.Thread(target=lambda: [sys.stderr.write(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
        _wait_for_the_end(parent)
    finally:
        _end_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
