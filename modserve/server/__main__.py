"""``python -m modserve.server``: the server as a module, as vLLM's image runs
``python -m vllm.entrypoints.openai.api_server``. It takes exactly the flags of
``modserve serve`` (``--log-level``, a flag of the ``modserve`` command itself, too)."""

from __future__ import annotations

import sys

from modserve.cli import main


def serve_argv(argv: list[str]) -> list[str]:
    """``[--log-level L] serve ARGS...`` for ``modserve.cli.main``, from the server's own ARGS."""
    head, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-level" and i + 1 < len(argv):
            head += argv[i:i + 2]
            i += 2
            continue
        (head if arg.startswith("--log-level=") else rest).append(arg)
        i += 1
    return [*head, "serve", *rest]


if __name__ == "__main__":
    sys.exit(main(serve_argv(sys.argv[1:])))
