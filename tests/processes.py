"""Processes as tests see them, through /proc (psutil is not a dependency): is one alive,
what runs below one, waiting for a condition."""

from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """A process that runs (a zombie counts: it is left behind too)."""
    return os.path.exists(f"/proc/{pid}")


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process below ``root``."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        found[child] = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    found[child] = "?"
                frontier.append(child)
    return found


def semaphores() -> set[str]:
    """The named POSIX semaphores multiprocessing made (``/dev/shm/sem.mp-*``): a process that
    dies with one unremoved leaves it there until the machine restarts."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.mp-")}


def wait_until(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
