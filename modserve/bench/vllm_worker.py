"""The ``vllm`` baseline's worker: one ``vllm.LLM``, driven by JSON lines on stdin.

Run by path with any Python that has vLLM (``python vllm_worker.py '<settings json>'``);
it imports nothing from modserve, which that Python may not have. Protocol, one JSON
object a line: first ``{"event": "imported", ...}`` (or ``{"error": ..., "kind": "import"}``
and exit 3), then ``{"event": "ready", ...}`` once the engine is built; after that one reply
per command:

- ``{"cmd": "generate", "requests": [{"prompt_token_ids": [...], "output_len": N}, ...]}``
  -> ``{"wall": s, "token_ids": [[...], ...]}``: all requests in one ``generate`` call,
  greedy, EOS ignored, exactly N tokens each; ``wall`` times that call alone.
- ``{"cmd": "latency", "prompt_token_ids": [...], "output_len": N}``
  -> ``{"ttft": s, "tpot": s, "e2el": s, "method": ...}``.
- ``{"cmd": "exit"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable


def private_streams() -> tuple[Any, Any]:
    """Our own copies of stdin and stdout for the protocol. fd 1 becomes stderr, so that
    whatever vLLM (or its engine processes, which inherit the fds) prints cannot corrupt the
    protocol, and fd 0 becomes /dev/null, so that no child reads our commands."""
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = sys.stderr
    return proto_in, proto_out


def _latency_from_metrics(out: Any, output_len: int) -> tuple[float, float] | None:
    """(TTFT, TPOT) from a RequestOutput's own timestamps, when this vLLM keeps them: V1's
    RequestStateStats (needs log stats on) or V0's RequestMetrics."""
    m = getattr(out, "metrics", None)
    if m is None:
        return None
    if getattr(m, "first_token_latency", 0.0) > 0 and getattr(m, "first_token_ts", 0.0) > 0:
        ttft, decode = m.first_token_latency, m.last_token_ts - m.first_token_ts
    elif getattr(m, "first_token_time", None) and getattr(m, "arrival_time", None):
        ttft, decode = m.first_token_time - m.arrival_time, m.last_token_time - m.first_token_time
    else:
        return None
    return ttft, (decode / (output_len - 1) if output_len > 1 else 0.0)


class Worker:
    def __init__(self, settings: dict[str, Any]) -> None:
        import vllm

        self.vllm = vllm
        start = time.perf_counter()
        kwargs = dict(model=settings["model"], dtype=settings["dtype"], seed=0,
                      max_model_len=settings["max_model_len"],
                      enable_prefix_caching=settings["enable_prefix_caching"])
        if settings.get("log_stats"):  # V1 fills RequestOutput.metrics only with stats on
            kwargs["disable_log_stats"] = False
        self.llm = vllm.LLM(**kwargs)
        self.startup_s = time.perf_counter() - start

    def info(self) -> dict[str, Any]:
        """What the header should say about this engine: version and the limits it chose."""
        info: dict[str, Any] = {"version": getattr(self.vllm, "__version__", "?"), "startup_s": self.startup_s}
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)  # V1; absent in V0
        sched, cache = getattr(config, "scheduler_config", None), getattr(config, "cache_config", None)
        for part, key in ((sched, "max_num_seqs"), (sched, "max_num_batched_tokens"),
                          (cache, "enable_prefix_caching")):
            if part is not None and hasattr(part, key):
                info[key] = getattr(part, key)
        return info

    def _params(self, n: int) -> Any:
        return self.vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def generate(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
        params = [self._params(r["output_len"]) for r in requests]
        self.llm.reset_prefix_cache()  # as modserve's runner: repeats must not hit the last run's prompts
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return {"wall": wall, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}

    def latency(self, prompt_token_ids: list[int], output_len: int) -> dict[str, Any]:
        prompt = [{"prompt_token_ids": prompt_token_ids}]
        self.llm.reset_prefix_cache()
        start = time.perf_counter()
        out = self.llm.generate(prompt, [self._params(output_len)], use_tqdm=False)[0]
        e2el = time.perf_counter() - start
        measured = _latency_from_metrics(out, output_len)
        if measured is not None:
            return {"ttft": measured[0], "tpot": measured[1], "e2el": e2el, "method": "metrics"}
        # No timestamps: a one-token run of the same prompt stands for TTFT, the rest is decode.
        start = time.perf_counter()
        self.llm.generate(prompt, [self._params(1)], use_tqdm=False)
        ttft = time.perf_counter() - start
        tpot = (e2el - ttft) / (output_len - 1) if output_len > 1 else 0.0
        return {"ttft": ttft, "tpot": tpot, "e2el": e2el, "method": "two-runs"}


def main() -> int:
    # Run by path, this file's folder heads sys.path; its siblings (plan.py, report.py, ...)
    # must not shadow top-level modules that vLLM or its dependencies import.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    proto_in, proto_out = private_streams()

    def send(obj: dict[str, Any]) -> None:
        proto_out.write(json.dumps(obj) + "\n")

    try:
        import vllm

        vllm.LLM, vllm.SamplingParams  # vllm imports these lazily: a broken install fails here, not later
    except Exception as e:  # ImportError, or a broken install failing inside vllm's imports
        send({"error": f"{type(e).__name__}: {e}", "kind": "import"})
        return 3
    send({"event": "imported", "version": getattr(vllm, "__version__", "?")})
    try:
        worker = Worker(json.loads(sys.argv[1]))
    except Exception:
        send({"error": traceback.format_exc(), "kind": "startup"})
        return 4
    send({"event": "ready", **worker.info()})
    serve(proto_in, send, {"generate": lambda cmd: worker.generate(cmd["requests"]),
                           "latency": lambda cmd: worker.latency(cmd["prompt_token_ids"], cmd["output_len"])})
    return 0


def serve(proto_in: Any, send: Callable[[dict[str, Any]], None],
          handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Answer each command line with its handler's reply (a failure's traceback as an error
    reply) until ``{"cmd": "exit"}`` or the end of input."""
    for line in proto_in:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        handler = handlers.get(cmd["cmd"])
        try:
            send(handler(cmd) if handler else {"error": f"unknown command {cmd['cmd']!r}"})
        except Exception:
            send({"error": traceback.format_exc()})


if __name__ == "__main__":
    sys.exit(main())
