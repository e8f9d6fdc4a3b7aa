"""Thread or process? Serve one model with the engine in a thread (modserve's design) or in
a child process, drive both with the same concurrent streaming clients, and compare.

    .venv/bin/python scripts/server_thread_vs_process.py --model DIR [--clients 16 --rounds 3 --max-tokens 128]

Also runs the engine alone (no HTTP) on the same batch as the ceiling. The process variant
is an experiment, kept here and not in the package: AsyncEngine with its command queue
replaced by a pipe to a child process that owns the LLMEngine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

PROMPT = "The quick brown fox jumps over the lazy dog while the engine streams tokens to"


# -- the engine in a child process ------------------------------------------------------------------


def child_main(config: dict[str, Any], conn: Any) -> None:
    from modserve.core.config import EngineConfig
    from modserve.engine.engine import LLMEngine
    from modserve.server.async_engine import _Abort, _Add, _Stop

    engine = LLMEngine(EngineConfig(**config), progress=False)
    conn.send("ready")
    while True:
        block = not engine.has_unfinished_requests()
        while block or conn.poll():
            cmd = conn.recv()
            block = False
            if isinstance(cmd, _Stop):
                return
            if isinstance(cmd, _Add):
                try:
                    engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.arrival_time)
                except Exception as e:
                    conn.send([(cmd.request_id, e)])
            elif isinstance(cmd, _Abort):
                engine.abort_request(cmd.request_id)
        outputs = engine.step()
        if outputs:
            conn.send([(o.request_id, o) for o in outputs])


def make_process_engine_class() -> type:
    from modserve.server.async_engine import AsyncEngine, _Stop

    class PipeQueue:
        def __init__(self, conn: Any) -> None:
            self.conn, self.lock = conn, threading.Lock()

        def put(self, item: Any) -> None:
            with self.lock:
                self.conn.send(item)

    class ProcessEngine(AsyncEngine):
        def start(self) -> None:
            self._loop = asyncio.get_running_loop()
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=child_main, args=(self.engine.config.model_dump(), child), daemon=True)
            self._proc.start()
            assert self._conn.recv() == "ready"
            self._commands = PipeQueue(self._conn)  # type: ignore[assignment]
            self._thread = threading.Thread(target=self._receive, daemon=True)
            self._thread.start()

        def _receive(self) -> None:
            while True:
                try:
                    batch = self._conn.recv()
                except (EOFError, OSError):
                    return
                self._emit(batch)

        def stop(self, timeout: float = 10.0) -> None:
            self._commands.put(_Stop())
            self._proc.join(timeout)
            self._conn.close()

        async def stats(self) -> dict[str, Any]:
            return {}

    return ProcessEngine


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from modserve.core.config import EngineConfig
    from modserve.engine.engine import LLMEngine
    from modserve.server import app as app_mod

    config = EngineConfig(model=args.model, num_kv_blocks=args.num_kv_blocks, max_model_len=1024,
                          num_threads=args.num_threads)
    if args.mode == "process":
        app_mod.AsyncEngine = make_process_engine_class()  # the experiment's one swap
        # The server process keeps an engine only for its settings and prompt checks: keep it small.
        engine = LLMEngine(EngineConfig(**{**config.model_dump(), "num_kv_blocks": 64}), progress=False)
        engine.config = config
    else:
        engine = LLMEngine(config, progress=False)
    uvicorn.run(app_mod.create_app(engine), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


# -- the load --------------------------------------------------------------------------------------------


async def stream_one(port: int, max_tokens: int) -> dict[str, Any]:
    """One streamed completion over a bare asyncio connection: the client stays cheap on 2 cores."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # status line and headers
    times, usage, buf = [], None, b""
    while True:
        size = int((await reader.readline()).strip(), 16)  # chunked transfer encoding
        if size == 0:
            break
        buf += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event[6:]
            if data == b"[DONE]":
                continue
            msg = json.loads(data)
            if msg["choices"]:
                times.append(time.perf_counter())
            elif msg.get("usage"):
                usage = msg["usage"]
    writer.close()
    return {"start": start, "times": times, "tokens": usage["completion_tokens"]}


async def load(port: int, clients: int, rounds: int, max_tokens: int) -> dict[str, float]:
    async def client() -> list[dict[str, Any]]:
        return [await stream_one(port, max_tokens) for _ in range(rounds)]

    await stream_one(port, 4)  # warm-up
    t0 = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(client() for _ in range(clients))) for r in rs]
    wall = time.perf_counter() - t0
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in results]
    q = statistics.quantiles(gaps, n=100)
    return {
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_ms": 1000 * statistics.mean(r["times"][0] - r["start"] for r in results),
        "tpot_ms": 1000 * statistics.mean(tpot),
        "itl_p50_ms": 1000 * q[49], "itl_p99_ms": 1000 * q[98],
        "tokens_per_chunk": sum(r["tokens"] for r in results) / sum(len(r["times"]) for r in results),
    }


def offline(model: str, num_kv_blocks: int, clients: int, rounds: int, max_tokens: int) -> dict[str, float]:
    from modserve.core.config import EngineConfig
    from modserve.engine.engine import LLMEngine
    from modserve.core.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=num_kv_blocks, max_model_len=1024), progress=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for r in range(rounds):
        for i in range(clients):
            engine.add_request(f"{r}-{i}", PROMPT, params)
        while engine.has_unfinished_requests():
            engine.step()
    return {"tok_s": clients * rounds * max_tokens / (time.perf_counter() - t0)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drive(args: argparse.Namespace) -> None:
    rows = {}
    if not args.skip_offline:
        rows["engine alone (no HTTP)"] = offline(args.model, args.num_kv_blocks, args.clients, args.rounds,
                                                 args.max_tokens)
    for mode in args.modes.split(","):
        port = free_port()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--port", str(port),
                                 "--model", args.model, "--num-kv-blocks", str(args.num_kv_blocks)]
                                + (["--num-threads", str(args.num_threads)] if args.num_threads else []))
        try:
            import httpx

            for _ in range(600):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            rows[f"server, engine in a {mode}"] = asyncio.run(load(port, args.clients, args.rounds, args.max_tokens))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    print(f"\n{args.clients} streaming clients x {args.rounds} requests x {args.max_tokens} tokens, "
          f"{os.cpu_count()} CPUs, model {os.path.basename(args.model)}")
    keys = ["tok_s", "ttft_ms", "tpot_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_chunk"]
    print("| setup | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.1f}" if k in row else "" for k in keys) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads in the engine")
    p.add_argument("--modes", default="thread,process")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--serve", choices=["thread", "process"], dest="mode", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    serve(args) if args.mode else drive(args)


if __name__ == "__main__":
    main()
