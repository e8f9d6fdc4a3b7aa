"""A baseline in a process of its own, driven by JSON lines over its stdin and stdout.

A baseline runs as its users run it: in its own process, so that nothing modserve sets
for its own (glibc's malloc thresholds, torch's settings, a different torch for vLLM)
reaches it. The worker answers each command with one JSON object a line; its first
lines say that it imported and started (see :mod:`.vllm_worker`, :mod:`.hf_worker`).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any


class WorkerProcess:
    """One worker process: ``argv`` started with ``env``; ``label`` names it in errors."""

    def __init__(self, argv: list[str], env: dict[str, str] | None, label: str) -> None:
        self.label = label
        # stderr is ours: the worker's logs show the user its progress
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                     bufsize=1)

    def receive(self) -> dict[str, Any]:
        """The worker's next reply; a reply with an error (but an import error) raises."""
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"{self.label} exited with code {code}; its stderr is above")
        reply = json.loads(line)
        if "error" in reply and reply.get("kind") != "import":
            raise RuntimeError(f"{self.label} failed:\n{reply['error']}")
        return reply

    def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send one command; its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)  # vLLM shuts its engine processes down
        except (OSError, subprocess.TimeoutExpired):  # a dead pipe, or a worker that hangs
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream:
                    stream.close()
            except OSError:  # the worker is gone: what it left unread does not matter
                pass

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
