"""Disaggregated serving across two hosts: the prefill server and the router on host a
(127.77.0.1), the decode server on host b (127.77.0.2), two network namespaces joined by a
veth pair (tests/netns.py). The prompt blocks go from a to b over TCP with ``kv_connector:
mooncake``, each side's transfer engine and side channel bound to its own host's address,
and each server with a /dev/shm of its own.

The client, on host a, gets through the router the greedy tokens one engine gives offline;
the decode server reads every whole prompt block but the last token's from host a and
computes none of them; afterwards both servers have all their KV blocks free, the producer
holds nothing, and no process is left in either namespace.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from netns import Host, two_hosts

from modserve import LLM, SamplingParams

try:
    from mooncake.engine import TransferEngine  # noqa: F401
except ImportError as e:  # the wheel is not installed, or libibverbs.so.1 is missing
    pytest.skip(f"Mooncake's transfer engine does not import here: {e}", allow_module_level=True)

BLOCK = 16
LENGTHS = (40, 77, 100, 5)  # full blocks 2, 4, 6, 0: none ends on the last token, so all are read
MAX_TOKENS = 8
PREFILL_PORT, DECODE_PORT, ROUTER_PORT, BOOTSTRAP_PORT = 8100, 8200, 8000, 8998
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Run on host a once the three servers are healthy: send each prompt through the router, then
# read both servers' /metrics. Prints one JSON object.
CLIENT = """
import json, sys, time, httpx
from prometheus_client.parser import text_string_to_metric_families
router, prefill, decode, prompts, max_tokens = json.loads(ARGS)
texts = []
for p in prompts:
    r = httpx.post(router + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": p,
                   "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    texts.append(r.json()["choices"][0]["text"])
def metrics(url):
    return {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in f.samples if not s.labels}
print(json.dumps({"texts": texts, "prefill": metrics(prefill), "decode": metrics(decode)}))
"""


def prompts() -> list[list[int]]:
    rng = random.Random(44)
    return [[rng.randrange(3, 4000) for _ in range(n)] for n in LENGTHS]


def serve(host: Host, log: Path, port: int, role: str, extra: dict, llama_dir: str) -> subprocess.Popen:
    config = {"kv_connector": "MooncakeConnector", "kv_role": role,
              "kv_connector_extra_config": {"hostname": host.address, **extra}}
    # Each server sees a /dev/shm of its own, as on two machines: a transfer through shared
    # memory could not pass for one over the network.
    own_shm = ("unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh")
    cmd = host.command(*own_shm, sys.executable, "-m", "modserve", "serve", "--model", llama_dir,
                       "--served-model-name", "tiny", "--host", host.address, "--port", str(port), "--dtype",
                       "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1",
                       "--kv-transfer-config", json.dumps(config))
    return start(cmd, log)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the server
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ONE_THREAD})


def stop(procs: list[subprocess.Popen]) -> list[int]:
    """Each one's exit code after SIGTERM (SIGKILL past 20 s): all signalled before any is waited
    for, so that their shutdowns overlap."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=20))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def pids_in(host: Host) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()


def test_prefill_on_one_host_decode_on_another(llama_dir, tmp_path):
    ps = prompts()
    with two_hosts() as (a, b):
        prefill_url, decode_url = f"http://{a.address}:{PREFILL_PORT}", f"http://{b.address}:{DECODE_PORT}"
        procs = []
        try:
            procs.append(serve(a, tmp_path / "prefill.log", PREFILL_PORT, "kv_producer",
                               {"bootstrap_port": BOOTSTRAP_PORT}, llama_dir))
            procs.append(serve(b, tmp_path / "decode.log", DECODE_PORT, "kv_consumer",
                               {"remote_bootstrap_addr": f"{a.address}:{BOOTSTRAP_PORT}"}, llama_dir))
            procs.append(start(a.command(sys.executable, "-m", "modserve", "router", "--prefill", prefill_url,
                                         "--decode", decode_url, "--host", a.address, "--port", str(ROUTER_PORT)),
                               tmp_path / "router.log"))
            args = [f"http://{a.address}:{ROUTER_PORT}", prefill_url, decode_url, ps, MAX_TOKENS]
            try:
                a.wait_healthy(prefill_url, decode_url, args[0], timeout=90)
                got = json.loads(a.run_python(f"ARGS = {json.dumps(args)!r}\n{CLIENT}", timeout=150, env=ONE_THREAD))
            except AssertionError as e:
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
                raise AssertionError(f"{e}\n{logs}") from e
        finally:
            codes = stop(procs)
        assert codes[:2] == [0, 0] and codes[2] in (0, -signal.SIGTERM), codes  # uvicorn re-raises SIGTERM
        assert pids_in(a) == [] and pids_in(b) == [], "a process was left on a host"

    prefill, decode = got["prefill"], got["decode"]
    usable = sum((n - 1) // BLOCK for n in LENGTHS)
    # The decode server read every whole block but the last token's from host a, all whole.
    assert decode["modserve_kv_connector_blocks_loaded_total"] == decode["modserve_kv_connector_blocks_read_total"]
    assert decode["modserve_kv_connector_blocks_read_total"] == usable > 0
    assert decode["modserve_kv_connector_blocks_load_failed_total"] == 0
    assert decode["modserve_kv_connector_blocks_stale_total"] == 0
    assert prefill["modserve_kv_connector_blocks_held"] == 0, "the producer still holds blocks read"
    for server in (prefill, decode):
        assert server["modserve_kv_blocks_free"] == server["modserve_kv_blocks_total"]

    llm = LLM(llama_dir, dtype="float32", progress=False, num_kv_blocks=64, max_model_len=256, block_size=BLOCK)
    try:
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert got["texts"] == [o.outputs[0].text for o in outs]
