"""Start-up time of the server: process start to the first token served over HTTP.

Starts `modserve serve` on a free port, asks `/v1/completions` for one token (the
official `openai` client, retrying while the server is not up), and prints the seconds
from `Popen` to that reply. `--cold` points inductor and torch's C++ extension builds at an empty cache
directory, so a compiled model pays its full first compile and the C++ kernels their
first build; without it the machine's caches are used, as on every start after the first.

    .venv/bin/python scripts/startup_time.py --model build/ref-small --repeats 3 [--cold]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(model: str, extra: list[str], cold: bool, timeout: float) -> float:
    port = free_port()
    env = dict(os.environ)
    cache = tempfile.TemporaryDirectory(prefix="inductor-cold-") if cold else None
    if cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache.name
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(cache.name, "extensions")
    cmd = [sys.executable, "-m", "modserve.cli", "--log-level", "WARNING", "serve", "--model", model,
           "--port", str(port), *extra]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                out = client.completions.create(model=model, prompt="Hello", max_tokens=1)
                if out.choices[0].text is not None:
                    return time.perf_counter() - start
            except (openai.APIConnectionError, openai.APIStatusError):
                time.sleep(0.1)
        raise TimeoutError(f"no token within {timeout:.0f} s")
    finally:
        proc.terminate()
        proc.wait(30)
        if cache:
            cache.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="empty inductor and C++ extension caches for every start")
    ap.add_argument("--timeout", type=float, default=600)
    args, extra = ap.parse_known_args()  # anything else goes to `modserve serve`
    times = []
    for i in range(args.repeats):
        times.append(one_start(args.model, extra, args.cold, args.timeout))
        print(f"start {i + 1}: {times[-1]:.1f} s to the first token", flush=True)
    print(f"median {statistics.median(times):.1f} s [{min(times):.1f}-{max(times):.1f}] over {len(times)} starts"
          f" ({'cold' if args.cold else 'warm'} inductor cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
