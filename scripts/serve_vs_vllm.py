"""modserve's server against vLLM's, on one machine, under `modserve bench serve`.

Starts both servers (modserve from this checkout, vLLM from the Python given; neither
installs anything), waits until each lists its model, then runs
``modserve bench serve --base-url <modserve> --baseline-url <vllm>`` with the arguments
after ``--``: the two are driven interleaved, the same arrivals per pair, and the
command prints both columns, their ratios and a PNG of the latency CDFs. Both servers
stop at the end, whatever happened; their logs go to ``--log-dir``.

    .venv/bin/python scripts/serve_vs_vllm.py --model build/ref-small \\
        --vllm-python ../vllm-venv/bin/python -- --workload custom \\
        --workload-path modserve/bench/data/reference-64.jsonl --request-rate 1.0 --repeats 3 \\
        --goodput ttft:2000 tpot:100 --plot build/serve-vs-vllm.png
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(name: str, command: list[str], port: int, log_dir: Path, timeout: float,
           env: dict[str, str]) -> Iterator[str]:
    """A server process, ready (its /v1/models answers) for the duration of the block."""
    log_path = log_dir / f"{name}.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            start, deadline = time.monotonic(), time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} before it served; see {log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not serve within {timeout:.0f} s; see {log_path}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                        break
                time.sleep(1)
            print(f"{name}: serving at {url} after {time.monotonic() - start:.0f} s (log: {log_path})", flush=True)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> int:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory both servers load")
    ap.add_argument("--vllm-python", required=True, help="a Python with vLLM installed")
    ap.add_argument("--vllm-dtype", default="auto",
                    help="vLLM's --dtype; default auto, vLLM's own default (a bf16 checkpoint computes in bf16)")
    ap.add_argument("--modserve-args", default="", help="extra `modserve serve` arguments, one string")
    ap.add_argument("--log-dir", default="build/serve-vs-vllm")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="s to wait for each server")
    ap.add_argument("--request-rates", type=float, nargs="+", default=[],
                    help="one bench run per rate (its --request-rate) against the same two servers, "
                    "started once; a --plot path gets the rate in its name")
    args = ap.parse_args(own)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; vLLM's CPU default wants more than a small box has
    modserve_port, vllm_port = free_port(), free_port()
    modserve_cmd = [sys.executable, "-m", "modserve", "--log-level", "warning", "serve", "--model", args.model,
                    "--port", str(modserve_port), *args.modserve_args.split()]
    vllm_cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                "--dtype", args.vllm_dtype, "--host", "127.0.0.1", "--port", str(vllm_port)]
    # vLLM first: it takes minutes to start, and an idle modserve beside it would cost nothing anyway
    with server("vllm", vllm_cmd, vllm_port, log_dir, args.start_timeout, env) as vllm_url, \
            server("modserve", modserve_cmd, modserve_port, log_dir, args.start_timeout, env) as modserve_url:
        bench = [sys.executable, "-m", "modserve", "--log-level", "warning", "bench", "serve",
                 "--base-url", modserve_url, "--baseline-url", vllm_url, "--names", "modserve", "vllm",
                 "--tokenizer", args.model]
        code = 0
        for rate_args in ([["--request-rate", str(r)] for r in args.request_rates] or [[]]):
            command = [*bench, *per_rate(bench_args, rate_args), *rate_args]
            print("+ " + " ".join(command), flush=True)
            code = code or subprocess.run(command).returncode
        return code


def per_rate(bench_args: list[str], rate_args: list[str]) -> list[str]:
    """``bench_args`` for one rate of a sweep: its --plot path named by the rate."""
    if not rate_args or "--plot" not in bench_args:
        return bench_args
    out = list(bench_args)
    i = out.index("--plot") + 1
    plot = Path(out[i])
    out[i] = str(plot.with_name(f"{plot.stem}-rate{rate_args[1]}{plot.suffix}"))
    return out


if __name__ == "__main__":
    sys.exit(main())
