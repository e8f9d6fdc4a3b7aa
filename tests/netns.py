"""Two hosts on one machine for multi-host tests: Linux network namespaces joined by a veth pair.

Each host is a network namespace of its own with one address in 127.77.0.0/24 (a loopback
range: nothing outside this machine is ever addressed), reached from the other host over the
veth pair and never from the test's own namespace. A process runs on a host by starting under
`ip netns exec` (`Host.command`); the test's HTTP clients run on a host the same way, or
through `Host.run_python`. Tests that need this skip where namespaces cannot be made (not
root, no CAP_SYS_ADMIN, no `ip`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator

import pytest

SUBNET = "127.77.0"


@dataclass(frozen=True)
class Host:
    name: str      # the network namespace
    address: str   # this host's address, reachable from the other host only
    device: str    # its end of the veth pair

    def command(self, *argv: str) -> list[str]:
        """argv run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run_python(self, code: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
        """Run `python -c code` on this host; its stdout, or an AssertionError with its output."""
        done = subprocess.run(self.command(sys.executable, "-c", code), capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})
        assert done.returncode == 0, f"on {self.name} (rc {done.returncode}):\n{done.stdout}\n{done.stderr}"
        return done.stdout


    def wait_healthy(self, *urls: str, timeout: float = 90) -> None:
        """Wait, from this host, until each of ``urls`` answers 200 on /health."""
        self.run_python(WAIT_HEALTHY, timeout=timeout + 30, env={"WAIT_HEALTHY": json.dumps([urls, timeout])})


WAIT_HEALTHY = """
import json, os, time, httpx
urls, timeout = json.loads(os.environ["WAIT_HEALTHY"])
deadline = time.monotonic() + timeout
for url in urls:
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not healthy after {timeout} s"
        time.sleep(0.2)
"""


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)


def _kill_everything_in(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Hosts a (127.77.0.1) and b (127.77.0.2), joined by a veth pair; removed on exit with
    every process still inside them."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to make network namespaces")
    tag = f"ms{os.getpid() % 100000}"
    hosts = (Host(f"{tag}a", f"{SUBNET}.1", f"{tag}va"), Host(f"{tag}b", f"{SUBNET}.2", f"{tag}vb"))
    try:
        _ip("netns", "add", hosts[0].name)
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"cannot make a network namespace here: {getattr(e, 'stderr', e)}")
    try:
        _ip("netns", "add", hosts[1].name)
        _ip("link", "add", hosts[0].device, "type", "veth", "peer", "name", hosts[1].device)
        for host in hosts:
            _ip("link", "set", host.device, "netns", host.name)
            run = ["-n", host.name]
            _ip(*run, "link", "set", "lo", "up")
            # 127/8 is "martian" off the loopback device unless route_localnet allows it
            subprocess.run(host.command("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"),
                           check=True, capture_output=True, timeout=30)
            _ip(*run, "addr", "add", f"{host.address}/24", "dev", host.device)
            _ip(*run, "link", "set", host.device, "up")
        yield hosts
    finally:
        for host in hosts:
            _kill_everything_in(host.name)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)
