"""``--data-parallel-backend ray``: a real server whose two engine cores are Ray actors of a local
cluster the server starts (server/ray_cores.py, plugins/executors/ray_cluster.py). One server
start, one thread per core:

- greedy tokens through the openai client are one offline engine's, both ranks generated some,
  and every KV block is free afterwards;
- ``kill -9`` of rank 1's actor process: its stream fails with an OpenAI-shaped error, rank 0's
  stream completes, /health turns 503 (the server stays up: --no-exit-on-engine-death);
- ``kill -9`` of the server: none of its processes is left, Ray's included (raylet, gcs_server,
  the agents, the actors), by its process tree and by a scan of /proc for the processes that
  inherited the server's environment.
"""

from __future__ import annotations

import os
import re
import signal
import uuid

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="--data-parallel-backend ray needs Ray: pip install modserve[ray]")

from modserve import LLM, SamplingParams  # noqa: E402
from processes import alive, descendants, wait_until  # noqa: E402
from server_process import free_port, launch_healthy  # noqa: E402

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(4)]
RAY_NAMES = re.compile(r"raylet|gcs_server|ray::|ray/dashboard|ray/_private|ray\.scripts|ray_cluster")


# In the server's environment, inherited by every process of the cluster it starts: another Ray
# cluster of this machine (a test run beside this one) is not this test's.
MARK = f"MODSERVE_TEST_DP_RAY={os.getpid()}-{uuid.uuid4().hex}"


def ray_processes() -> dict[int, str]:
    """pid -> command line of every process of this machine that is Ray's (or our cluster
    supervisor) and carries ``MARK``."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                if not RAY_NAMES.search(cmd):
                    continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if MARK.encode() not in f.read().split(b"\0"):
                        continue
            except OSError:
                continue
            found[int(entry)] = cmd
    return found


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[str]:
    with LLM(llama_dir, num_threads=1, num_kv_blocks=64, max_model_len=512, progress=False) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_dp2_over_ray_same_tokens_a_killed_actor_fails_its_requests_and_kill9_leaves_nothing(
        llama_dir, tmp_path, reference):
    before = set(ray_processes())
    server = launch_healthy(
        tmp_path, "dp-ray", llama_dir, "--served-model-name", "tiny", "--num-threads", "1", "--num-kv-blocks", "160",
        "--max-model-len", "2048", "-dp", "2", "--data-parallel-backend", "ray", "--data-parallel-routing", "load",
        "--data-parallel-rpc-port", str(free_port()), "--no-exit-on-engine-death", timeout=300,
        env={"RAY_ADDRESS": "", **dict([MARK.split("=")])})
    tree: dict[int, str] = {}
    try:
        log = server.log.read_text()
        pids = {int(r): int(p) for r, p in re.findall(r"engine core (\d) \(pid (\d+)\): building", log)}
        assert sorted(pids) == [0, 1], log
        tree = descendants(server.proc.pid)
        for rank, pid in pids.items():  # each core is a Ray actor process of the cluster the server started
            assert pid in tree and tree[pid].startswith("ray::CoreActor"), (rank, pid, tree)
        assert "placed on node" in log

        client = server.client()
        greedy = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
        r = client.completions.create(model="tiny", prompt=PROMPTS, **greedy)
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == reference
        m = server.metrics()
        for rank in (0, 1):
            assert m.get(f'modserve_replica_generation_tokens_total{{replica={rank}}}', 0) > 0, (rank, m)
        assert wait_until(lambda: server.metrics()["modserve_kv_blocks_used"] == 0), server.metrics()

        # Load routing: the first stream goes to rank 0, the second to rank 1, whose actor is killed.
        long = dict(temperature=0.0, max_tokens=480, extra_body={"ignore_eos": True})
        survivor = client.completions.create(model="tiny", prompt=PROMPTS[1], stream=True,
                                             **{**long, "max_tokens": 600})
        next(iter(survivor))
        doomed = client.completions.create(model="tiny", prompt=PROMPTS[0], stream=True, **long)
        next(iter(doomed))
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(openai.APIError) as failed:
            for _ in doomed:
                pass
        assert failed.value.code == "engine_dead", failed.value
        assert [c.choices[0].finish_reason for c in survivor if c.choices][-1] == "length"
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        assert "engine core 1" in server.log.read_text() and "its connection closed" in server.log.read_text()

        tree = descendants(server.proc.pid)
        assert any("raylet" in cmd for cmd in tree.values()), tree  # the cluster is the server's
        server.proc.kill()
        server.proc.wait()
        assert wait_until(lambda: not [p for p in tree if alive(p)], 60), \
            {p: tree[p] for p in tree if alive(p)}
        left = {p: c for p, c in ray_processes().items() if p not in before}
        assert not left, f"Ray processes left after kill -9 of the server: {left}"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        for pid in tree:  # nothing of a failed run stays behind for the next test
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.mark.parametrize("flags, message", [
    (["--headless"], "--headless starts this machine's engine cores as processes"),
    (["--data-parallel-rank", "1"], "takes no --data-parallel-size-local, --data-parallel-rank"),
    (["--data-parallel-size-local", "1"], "takes no --data-parallel-size-local"),
])
def test_what_ray_placement_does_not_combine_with_is_refused_by_name(llama_dir, flags, message):
    from modserve import cli

    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.main(["serve", llama_dir, "-dp", "2", "-dpb", "ray", "--data-parallel-rpc-port", str(free_port()),
                  *flags])
