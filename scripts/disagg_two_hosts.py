"""Disaggregated prefill/decode across two hosts against one co-located server.

    sudo .venv/bin/python scripts/disagg_two_hosts.py [--model DIR] [--repeats 3]

The two hosts are network namespaces joined by a veth pair (tests/netns.py: 127.77.0.1 and
127.77.0.2), so it needs root. Host a runs the KV producer (core 0, one thread), the router
and the co-located server (both cores, two threads); host b runs the KV consumer (core 1,
one thread). The prompt blocks go from a to b with `kv_connector: mooncake` over TCP. Then
`modserve bench serve`, on host a, drives the router and the co-located server with the same
long-prompt workload and arrivals, interleaved, and prints the comparison (TTFT, ITL p50/p99,
throughput). Without --model it uses the 88M-parameter `small` Llama with random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from netns import Host, two_hosts  # noqa: E402

MODELNAME = "llama-small-88M"
PORTS = {"colocated": 8300, "producer": 8100, "consumer": 8200, "router": 8000}
BOOTSTRAP = 8998
WAIT = """
import sys, time, httpx
deadline = time.monotonic() + 600
for url in sys.argv[1:]:
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, url + " not healthy"
        time.sleep(0.5)
"""


def start(host: Host, argv: list[str], log: Path, cpus: str) -> subprocess.Popen:
    with open(log, "w") as f:  # a file: a full pipe would stall the server
        return subprocess.Popen(host.command("taskset", "-c", cpus, sys.executable, "-m", "modserve", *argv),
                                stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)


def mooncake(role: str, **options) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                                                "kv_connector_extra_config": options})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the random-weight small Llama)")
    parser.add_argument("--input-len", type=int, default=768)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", default=None, help="the CDF plot's PNG path")
    args = parser.parse_args()
    if args.model is None:
        from modserve.testing import cached_checkpoint
        args.model = str(cached_checkpoint("llama", "small"))
    tmp = Path(tempfile.mkdtemp(prefix="disagg-hosts-"))
    common = ["serve", args.model, "--served-model-name", MODELNAME, "--dtype", "float32", "--compile", "off",
              "--max-model-len", "2048", "--kv-cache-memory-gb", "1",
              "--no-enable-prefix-caching"]  # every repeat sends the same prompts: no server may remember them
    with two_hosts() as (a, b):
        url = {"colocated": a, "producer": a, "router": a, "consumer": b}
        url = {name: f"http://{host.address}:{PORTS[name]}" for name, host in url.items()}
        procs = []
        try:
            procs.append(start(a, [*common, "--host", a.address, "--port", str(PORTS["colocated"]),
                                   "--num-threads", "2"], tmp / "colocated.log", "0,1"))
            procs.append(start(a, [*common, "--host", a.address, "--port", str(PORTS["producer"]), "--num-threads",
                                   "1", *mooncake("kv_producer", hostname=a.address, bootstrap_port=BOOTSTRAP)],
                               tmp / "producer.log", "0"))
            procs.append(start(b, [*common, "--host", b.address, "--port", str(PORTS["consumer"]), "--num-threads",
                                   "1", *mooncake("kv_consumer", hostname=b.address,
                                                  remote_bootstrap_addr=f"{a.address}:{BOOTSTRAP}")],
                               tmp / "consumer.log", "1"))
            procs.append(start(a, ["router", "--prefill", url["producer"], "--decode", url["consumer"], "--host",
                                   a.address, "--port", str(PORTS["router"])], tmp / "router.log", "0,1"))
            subprocess.run(a.command(sys.executable, "-c", WAIT, *url.values()), check=True, timeout=660)
            bench = [sys.executable, "-m", "modserve", "bench", "serve", "--base-url", url["router"],
                     "--baseline-url", url["colocated"], "--names", "disaggregated", "co-located", "--model",
                     MODELNAME, "--tokenizer", args.model, "--workload", "random", "--input-len",
                     str(args.input_len), "--output-len", str(args.output_len), "--range-ratio", "0.25",
                     "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                     "--ignore-eos", "--repeats", str(args.repeats), "--warmups", "2"]
            if args.plot:
                bench += ["--plot", args.plot]
            print("+", " ".join(bench), flush=True)
            code = subprocess.call(a.command(*bench), cwd=ROOT)
            metrics = subprocess.run(a.command(sys.executable, "-c", "import httpx, sys; print(httpx.get("
                                               "sys.argv[1] + '/metrics').text)", url["consumer"]),
                                     capture_output=True, text=True).stdout
            print("consumer:", *[line for line in metrics.splitlines() if line.startswith(
                ("modserve_kv_connector_blocks", "modserve_kv_connector_bytes", "modserve_prompt_tokens"))],
                sep="\n  ")
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
            print("logs:", tmp, file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers and namespaces are removed
    main()
