"""Data parallel across machines: the API server on host a holds rank 0, `modserve serve
--headless` on host b holds rank 1 (two network namespaces, tests/netns.py: the ranks reach
each other over tcp only, as on two machines).

- Greedy tokens through host a's server are one engine's, and rank 1's engine on host b
  generated some of them (its per-replica counter, read from its own stats).
- `kill -9` of host b's engine core: its stream fails with an OpenAI-shaped error, rank 0's
  completes, the server drains and exits 1 (exit_on_engine_death, as with a core on its own
  machine), host b's supervisor exits too, and nothing is left in either namespace.

Also, without processes: the handshake refuses a rank whose config differs, naming what differs,
and gives up on a rank that never joins, naming it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest
import zmq

from modserve import LLM, SamplingParams
from modserve.core.config import EngineConfig
from modserve.engine import core_handshake as h
from modserve.engine.core_protocol import PROTOCOL_VERSION
from modserve.server.core_launch import EngineStartError
from modserve.server.remote_cores import await_remote_cores, bind_remote_core
from netns import two_hosts
from processes import wait_until

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(4)]
FLAGS = ["--served-model-name", "tiny", "--num-threads", "1", "--num-kv-blocks", "160", "--max-model-len", "2048",
         "-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.77.0.1",
         "--data-parallel-rpc-port", "29550", "--data-parallel-routing", "load"]

# Run on host a: every request and the kill, since the test's own namespace cannot reach host a.
CLIENT = r"""
import json, os, re, signal, time
import httpx, openai
cfg = json.loads(os.environ["MULTINODE_TEST"])
url = cfg["url"]
client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
greedy = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
r = client.completions.create(model="tiny", prompt=cfg["prompts"], **greedy)
out = {"texts": [c.text for c in sorted(r.choices, key=lambda c: c.index)]}
m = re.search(r'modserve_replica_generation_tokens_total\{replica="1"\} (\S+)', httpx.get(url + "/metrics").text)
out["rank1_tokens"] = float(m.group(1)) if m else None
long = dict(temperature=0.0, max_tokens=480, extra_body={"ignore_eos": True})
# Load routing: the first stream goes to rank 0, the second to rank 1 (host b).
survivor = client.completions.create(model="tiny", prompt=cfg["prompts"][1], stream=True, **{**long, "max_tokens": 700})
next(iter(survivor))
doomed = client.completions.create(model="tiny", prompt=cfg["prompts"][0], stream=True, **long)
next(iter(doomed))
os.kill(cfg["core_pid"], signal.SIGKILL)
try:
    for chunk in doomed:
        pass
    out["doomed"] = "finished"
except openai.APIError as e:
    out["doomed"] = {"code": e.code, "message": str(e)}
out["health"] = httpx.get(url + "/health", timeout=5).status_code
out["survivor"] = [c.choices[0].finish_reason for c in survivor if c.choices][-1]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[str]:
    with LLM(llama_dir, num_threads=1, num_kv_blocks=64, max_model_len=512, progress=False) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def serve(host, log, *flags: str) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the process
        return subprocess.Popen(host.command(sys.executable, "-m", "modserve", "--log-level", "info", "serve", *flags),
                                stdout=f, stderr=subprocess.STDOUT)


def netns_pids(host) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()


def test_a_headless_node_serves_rank_1_and_its_killed_core_ends_both_hosts(llama_dir, tmp_path, reference):
    with two_hosts() as (a, b):
        head_log, node_log = tmp_path / "head.log", tmp_path / "node.log"
        head = serve(a, head_log, llama_dir, *FLAGS, "--host", a.address, "--port", "8000")
        node = serve(b, node_log, llama_dir, *FLAGS, "--data-parallel-start-rank", "1", "--headless")
        try:
            assert wait_until(lambda: "engine core 1 (pid" in node_log.read_text(), 30), node_log.read_text()
            core_pid = int(re.search(r"engine core 1 \(pid (\d+)\)", node_log.read_text()).group(1))
            cfg = {"url": f"http://{a.address}:8000", "prompts": PROMPTS, "core_pid": core_pid}
            a.wait_healthy(cfg["url"], timeout=60)
            out = json.loads(a.run_python(CLIENT, timeout=120, env={"MULTINODE_TEST": json.dumps(cfg)}))
            assert out["texts"] == reference
            assert out["rank1_tokens"], "rank 1 (host b) generated none of the tokens"
            assert out["doomed"] != "finished" and out["doomed"]["code"] == "engine_dead", out
            assert out["health"] == 503 and out["survivor"] == "length"
            assert head.wait(timeout=30) == 1  # exit_on_engine_death, as with a core on the server's machine
            assert node.wait(timeout=30) == 1  # its core died: the supervisor ends too
            head_text = head_log.read_text()
            assert f"engine core 1 (pid {core_pid}) on " in head_text and "its connection closed" in head_text
            assert "data parallel: rank 1 joined from" in head_text
            assert wait_until(lambda: not netns_pids(a) and not netns_pids(b), 15), (netns_pids(a), netns_pids(b))
        finally:
            for proc in (head, node):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


# -- the handshake, without processes ----------------------------------------------------------------
def join(port: int, rank: int, config: EngineConfig) -> h.Answer:
    """A core's side of the handshake: what the API server answered."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(h.encode(h.Handshake(rank, PROTOCOL_VERSION, h.fingerprint(config), "node-b")))
    try:
        assert dealer.poll(10_000), "no answer"
        return h.decode_answer(dealer.recv())
    finally:
        dealer.close()
        context.term()


def serve_handshakes(ranks: list[int], config: EngineConfig, timeout: float):
    from server_process import free_port

    port = free_port()
    launches = [bind_remote_core(r, "127.0.0.1") for r in ranks]
    result: dict = {}

    def run() -> None:
        try:
            await_remote_cores(launches, "127.0.0.1", port, config, timeout)
            result["ok"] = True
        except EngineStartError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    return port, launches, thread, result


def test_the_handshake_refuses_a_differing_config_by_name_and_welcomes_a_matching_one(llama_dir):
    config = EngineConfig(model=llama_dir, data_parallel_size=2, max_model_len=512)
    port, launches, thread, result = serve_handshakes([1], config, 30)
    try:
        other = config.model_copy(update={"max_model_len": 256, "num_threads": 3})  # threads: each node's own
        refused = join(port, 1, other)
        assert isinstance(refused, h.Refused)
        assert "max_model_len (API server: 512, this rank: 256)" in refused.reason
        assert "num_threads" not in refused.reason
        assert isinstance(join(port, 0, config), h.Refused)  # not a rank this server waits for
        welcome = join(port, 1, config.model_copy(update={"num_threads": 3}))
        assert isinstance(welcome, h.Welcome) and welcome.inbox.startswith("tcp://127.0.0.1:")
        thread.join(10)
        assert result == {"ok": True}
    finally:
        thread.join(10)
        for launch in launches:
            launch.kill()
            launch.close()


def test_a_rank_that_never_joins_is_named_when_the_start_times_out(llama_dir):
    config = EngineConfig(model=llama_dir, data_parallel_size=3)
    began = time.monotonic()
    _, launches, thread, result = serve_handshakes([1, 2], config, 0.5)
    thread.join(10)
    for launch in launches:
        launch.kill()
        launch.close()
    assert "rank(s) [1, 2] did not join" in result["error"] and time.monotonic() - began < 5


# A core on another machine, reduced to its watch: it ends itself once the server's socket goes.
WATCHED = r"""
import sys, time, zmq
from modserve.engine.remote_core import end_with_server
context = zmq.Context()
inbox = context.socket(zmq.PULL)
inbox.connect(sys.argv[1])
time.sleep(0.5)  # connected before the watch begins: it must still see the connection drop
end_with_server(inbox, sys.argv[1])
print("watching", flush=True)
time.sleep(60)
"""


def test_a_remote_core_ends_itself_once_its_server_connection_drops():
    context = zmq.Context()
    server = context.socket(zmq.PUSH)
    address = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    # a session of its own, as a core has: its watch SIGKILLs its whole process group
    core = subprocess.Popen([sys.executable, "-c", WATCHED, address], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert core.stdout.readline().strip() == "watching"
        time.sleep(0.3)
        assert core.poll() is None
        server.close(linger=0)  # the API server's process ends: its connections close
        assert core.wait(timeout=10) == -9
    finally:
        if core.poll() is None:
            core.kill()
            core.wait()
        context.term()


def test_vllms_multinode_flags_and_config_keys_reach_the_server_with_vllms_defaults(llama_dir, tmp_path):
    from modserve.cli import build_parser, config_from_args
    from modserve.server.cli import dp_layout

    def layout(*argv: str) -> tuple:
        args = build_parser().parse_args(["serve", *argv])
        config = config_from_args(args)
        return (*dp_layout(args, config), bool(args.vllm_headless))

    assert layout(llama_dir, "-dp", "4") == (4, 0, "127.0.0.1", 29550, False)  # vLLM's defaults
    assert layout(llama_dir, "-dp", "4", "-dpl", "2", "-dpr", "2", "-dpa", "10.0.0.1", "-dpp", "13345",
                  "--headless") == (2, 2, "10.0.0.1", 13345, True)
    path = tmp_path / "vllm.yaml"  # a `vllm serve` config file's keys, as vLLM spells them
    path.write_text(f"model: {llama_dir}\ndata-parallel-size: 2\ndata-parallel-size-local: 1\n"
                    "data-parallel-start-rank: 1\ndata-parallel-address: 10.0.0.2\ndata-parallel-rpc-port: 1234\n"
                    "headless: true\n")
    assert layout("--config", str(path)) == (1, 1, "10.0.0.2", 1234, True)
