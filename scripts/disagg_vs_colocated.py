"""Disaggregated prefill/decode against one co-located server, on one machine.

    .venv/bin/python scripts/disagg_vs_colocated.py [--model DIR] [--out docs/figures/disagg-vs-colocated.png]

Starts four real processes: a co-located `modserve serve` with both cores, a KV producer
and a KV consumer with one core each (`--kv-connector shm`), and `modserve router` in
front of those two; then `modserve bench serve` drives the router and the co-located
server with the same long-prompt workload and arrivals, interleaved, and writes the
comparison (TTFT, ITL p50/p99, throughput) and its CDF plot. Without --model it uses the
88M-parameter `small` Llama with random weights.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODELNAME = "llama-small-88M"  # the served name: it titles the plot


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, cpus: str) -> subprocess.Popen:
    with open(log, "w") as f:  # a file: a full pipe would stall the server
        return subprocess.Popen(["taskset", "-c", cpus, sys.executable, "-m", "modserve", *args],
                                stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy after {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the random-weight small Llama)")
    parser.add_argument("--input-len", type=int, default=768)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "docs/figures/disagg-vs-colocated.png"))
    parser.add_argument("--json", default=None, help="write bench serve's full result here")
    args = parser.parse_args()
    if args.model is None:
        from modserve.testing import cached_checkpoint
        args.model = str(cached_checkpoint("llama", "small"))
    tmp = Path(tempfile.mkdtemp(prefix="disagg-"))
    common = ["serve", args.model, "--served-model-name", MODELNAME, "--dtype", "float32", "--compile", "off",
              "--max-model-len", "2048", "--kv-cache-memory-gb", "1",
              "--no-enable-prefix-caching"]  # every repeat sends the same prompts: no server may remember them
    ports = {name: free_port() for name in ("colocated", "producer", "consumer", "router")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["colocated"] = start([*common, "--port", str(ports["colocated"]), "--num-threads", "2"],
                                   tmp / "colocated.log", "0,1")
        for role, cpu in (("producer", "0"), ("consumer", "1")):
            procs[role] = start([*common, "--port", str(ports[role]), "--num-threads", "1", "--kv-connector", "shm",
                                 "--kv-role", role], tmp / f"{role}.log", cpu)
        for name in ("colocated", "producer", "consumer"):
            wait_healthy(url[name], procs[name], tmp / f"{name}.log")
        procs["router"] = start(["router", "--prefill", url["producer"], "--decode", url["consumer"], "--port",
                                 str(ports["router"])], tmp / "router.log", "0,1")
        wait_healthy(url["router"], procs["router"], tmp / "router.log")
        bench = [sys.executable, "-m", "modserve", "bench", "serve", "--base-url", url["router"], "--baseline-url",
                 url["colocated"], "--names", "disaggregated", "co-located", "--model", MODELNAME, "--tokenizer",
                 args.model, "--workload", "random", "--input-len", str(args.input_len), "--output-len",
                 str(args.output_len), "--range-ratio", "0.25", "--num-prompts", str(args.num_prompts),
                 "--request-rate", str(args.request_rate), "--ignore-eos", "--repeats", str(args.repeats),
                 "--warmups", "2", "--plot", args.out]
        if args.json:
            bench += ["--output-json", args.json]
        print("+", " ".join(bench), flush=True)
        code = subprocess.call(bench, cwd=ROOT)
        stats = httpx.get(f"{url['consumer']}/metrics").text
        print("consumer:", *[line for line in stats.splitlines()
                             if line.startswith(("modserve_kv_connector_blocks", "modserve_prompt_tokens"))], sep="\n  ")
        raise SystemExit(code)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
        print("logs:", tmp, file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
