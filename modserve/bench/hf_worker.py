"""The ``hf`` baseline's worker: :class:`~modserve.bench.hf_baseline.StaticBatches` in a
process of its own, driven by JSON lines on stdin (``python -m modserve.bench.hf_worker
'<settings json>'``).

Protocol, one JSON object a line: ``{"event": "ready"}`` once the model is loaded (or
``{"error": ...}`` and exit 4); then for ``{"cmd": "generate", "requests":
[{"prompt_token_ids": [...], "output_len": N}, ...]}`` the reply ``{"wall": s,
"token_ids": [[...], ...]}``, and ``{"cmd": "exit"}`` ends it.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any


def main() -> int:
    from modserve.bench.vllm_worker import private_streams, serve

    proto_in, proto_out = private_streams()

    def send(obj: dict[str, Any]) -> None:
        proto_out.write(json.dumps(obj) + "\n")

    try:
        import torch

        from modserve.bench.hf_baseline import StaticBatches
        from modserve.bench.workloads import BenchRequest

        settings = json.loads(sys.argv[1])
        torch.set_num_threads(settings["threads"])
        generate = StaticBatches(settings["model"], getattr(torch, settings["dtype"]), settings["batch_size"])
    except Exception:
        send({"error": traceback.format_exc(), "kind": "startup"})
        return 4
    send({"event": "ready"})

    def generate_all(cmd: dict[str, Any]) -> dict[str, Any]:
        run = generate.run([BenchRequest(None, r["prompt_token_ids"], r["output_len"]) for r in cmd["requests"]])
        return {"wall": run.wall, "token_ids": run.token_ids}

    serve(proto_in, send, {"generate": generate_all})
    return 0


if __name__ == "__main__":
    sys.exit(main())
