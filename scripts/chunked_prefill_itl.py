"""Inter-token latency of running decodes when a 2,000-token prompt arrives, with and
without chunked prefill. Starts `modserve serve` for each setting and drives it with
`modserve bench serve`; prints a markdown table of the results.

    python scripts/chunked_prefill_itl.py [--model DIR] [--chunk 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from modserve.testing import cached_checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(path: Path, vocab: int) -> None:
    """8 decodes of 160 tokens; the 5th request is a 2,000-token prompt with 4 output tokens."""
    rows = [{"prompt_token_ids": [(7 * i + j) % (vocab - 10) + 5 for j in range(24)], "output_tokens": 160}
            for i in range(8)]
    rows.insert(4, {"prompt_token_ids": [(13 * j) % (vocab - 10) + 5 for j in range(1990)], "output_tokens": 4})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def serve_and_bench(model: str, flags: list[str], work: Path, out: Path) -> dict:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "modserve", "--log-level", "WARNING", "serve", "--model", model, "--port", str(port),
         "--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks", "1024", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if server.poll() is not None:
                raise RuntimeError(f"modserve serve {' '.join(flags)} exited with status {server.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        subprocess.run([sys.executable, "-m", "modserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                        "--workload", "custom", "--workload-path", str(work), "--request-rate", "8", "--seed", "0",
                        "--result-json", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["runs"][0]
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the tiny random-weight Llama")
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens with chunked prefill")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    model = a.model or str(cached_checkpoint("llama"))
    settings = {
        f"chunked ({a.chunk}-token budget)": ["--max-num-batched-tokens", str(a.chunk)],
        "not chunked": ["--max-num-batched-tokens", "2048", "--scheduler", "{name: fcfs, options: {chunked_prefill: false}}"],
    }
    results: dict[str, list[dict]] = {k: [] for k in settings}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work.jsonl"
        workload(work, vocab=4096)
        for r in range(a.repeats):  # interleaved, so machine drift hits both alike
            for name, flags in settings.items():
                results[name].append(serve_and_bench(model, flags, work, Path(tmp) / f"{r}.json"))
    print("| setting | ITL p99 ms | ITL max ms | ITL median ms | TTFT p99 ms |\n|---|---|---|---|---|")
    for name, runs in results.items():
        def med(values: list[float]) -> str:
            return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"

        p99 = med([run["itl_ms"]["p99"] for run in runs])
        worst = med([1000 * max(x for r in run["requests"] for x in r["itl"]) for run in runs])
        median = med([run["itl_ms"]["median"] for run in runs])
        ttft = med([run["ttft_ms"]["p99"] for run in runs])
        print(f"| {name} | {p99} | {worst} | {median} | {ttft} |")


if __name__ == "__main__":
    main()
