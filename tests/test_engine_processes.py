"""The engine in processes of its own (modserve/engine/core_process.py, server/engine_process.py).

Real `modserve serve` processes, the official openai client, real signals:
- `-dp 2`: two engine-core processes answer as one engine does; /health and /metrics answer
  at once while both step; `kill -9` of one core fails its stream and lets the other's
  finish, then the server drains and exits 1 (exit_on_engine_death) leaving no process.
- `SIGSTOP` of an engine core mid-stream: the client gets an OpenAI-shaped error within the
  step deadline and the server exits 1; the stopped core is killed, nothing is left.
- `SIGSTOP` of a tensor-parallel worker (the core's step hangs in a collective) with
  --no-exit-on-engine-death: the error within the deadline, /health 503 naming the hung
  step, /metrics still under a second, and SIGTERM then leaves nothing.
- `-dp 2 -tp 2`: two cores of two ranks each answer as one engine does; `kill -9` of the
  server then takes both cores and their workers.

Every server here: the tiny llama, one thread per process, a small KV cache.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import zmq

from modserve import LLM, SamplingParams
from processes import alive, descendants, semaphores, wait_until
from server_process import Server, launch_healthy, stop

MODEL = "tiny"
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(4)]
FLAGS = ["--served-model-name", MODEL, "--num-threads", "1", "--num-kv-blocks", "64", "--max-model-len", "512"]
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
LONG = dict(temperature=0.0, max_tokens=480, extra_body={"ignore_eos": True})
STEP_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[str]:
    with LLM(llama_dir, num_threads=1, num_kv_blocks=64, max_model_len=512, progress=False) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def cores_of(server: Server) -> dict[int, int]:
    """dp rank -> pid of each engine-core process, as the server logged them."""
    return {int(rank): int(pid) for rank, pid in
            re.findall(r"engine core (\d+) \(pid (\d+)\): building", server.log.read_text())}


def start(tmp, name: str, *flags: str) -> Server:
    return launch_healthy(tmp, name, *flags, timeout=180)


def timed_get(url: str) -> tuple[httpx.Response, float]:
    t = time.monotonic()
    r = httpx.get(url, timeout=5)
    return r, time.monotonic() - t


def assert_all_gone(pids, timeout: float = 15.0) -> None:
    assert wait_until(lambda: not any(alive(p) for p in pids), timeout), \
        {p: descendants(1).get(p, "?") for p in pids if alive(p)}


def greedy_texts(server: Server) -> list[str]:
    r = server.client().completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_dp2_cores_answer_as_one_engine_and_a_killed_core_fails_only_its_requests(llama_dir, tmp_path, reference):
    server = start(tmp_path, "dp2", llama_dir, *FLAGS, "-dp", "2", "--data-parallel-routing", "load",
                   "--max-model-len", "2048", "--num-kv-blocks", "160")
    try:
        tree = descendants(server.proc.pid)
        cores = cores_of(server)
        assert sorted(cores) == [0, 1] and all(alive(pid) for pid in cores.values())
        assert greedy_texts(server) == reference
        client = server.client()
        # Two long streams: load routing puts the first on core 0, the second on core 1.
        doomed = client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **LONG)
        next(iter(doomed))
        # (long enough to still run while the dead core's request fails and the checks below run)
        survivor = client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True,
                                             **{**LONG, "max_tokens": 2000})
        next(iter(survivor))
        for path in ("/health", "/metrics"):  # answered by the API server, never waiting on a core
            r, took = timed_get(server.url + path)
            assert r.status_code == 200 and took < 1.0, (path, took)
        # summed over the cores' heartbeats (each at most a second old)
        assert wait_until(lambda: server.metrics()["modserve_num_requests_running"] == 2, 5)
        os.kill(cores[0], signal.SIGKILL)
        with pytest.raises(openai.APIError) as error:
            for chunk in doomed:
                assert not chunk.choices or chunk.choices[0].finish_reason is None, "the stream finished"
        assert error.value.code == "engine_dead" and "the engine stopped" in str(error.value)
        # Draining the other core's request: still listening, unhealthy, scraped at once.
        health, took = timed_get(server.url + "/health")
        assert health.status_code == 503 and took < 1.0
        r, took = timed_get(server.url + "/metrics")
        assert r.status_code == 200 and took < 1.0 and "modserve_replica_alive" in r.text
        finish = [chunk.choices[0].finish_reason for chunk in survivor if chunk.choices]
        assert finish[-1] == "length"  # the other core's request completed during the drain
        assert server.proc.wait(timeout=30) == 1  # exit_on_engine_death: drained, then status 1
        assert_all_gone(tree)
        assert f"engine dead: engine core 0 (pid {cores[0]}) exited with code -9" in server.log.read_text()
    finally:
        stop(server)


def test_a_stopped_engine_core_is_declared_dead_within_the_step_deadline(llama_dir, tmp_path):
    server = start(tmp_path, "stopped-core", llama_dir, *FLAGS, "--step-timeout", str(STEP_TIMEOUT))
    try:
        tree = descendants(server.proc.pid)
        [core] = cores_of(server).values()
        stream = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **LONG)
        next(iter(stream))
        os.kill(core, signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(openai.APIError) as error:
            for _ in stream:
                pass
        assert time.monotonic() - began < STEP_TIMEOUT + 3
        assert error.value.code == "engine_dead"
        assert server.proc.wait(timeout=30) == 1
        assert f"(pid {core}) sent no heartbeat" in server.log.read_text()
        assert_all_gone(tree)  # the stopped core was killed, not left stopped
    finally:
        stop(server)


def test_a_hung_tp_worker_turns_health_503_and_metrics_still_answer(llama_dir, tmp_path):
    before = semaphores()
    server = start(tmp_path, "hung-worker", llama_dir, *FLAGS, "-tp", "2", "--step-timeout", str(STEP_TIMEOUT),
                   "--no-exit-on-engine-death")
    try:
        tree = descendants(server.proc.pid)
        [core] = cores_of(server).values()
        [worker] = [p for p, cmd in descendants(core).items() if "spawn_main" in cmd]
        stream = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **LONG)
        next(iter(stream))
        os.kill(worker, signal.SIGSTOP)  # the core's next collective waits for it forever
        began = time.monotonic()
        with pytest.raises(openai.APIError) as error:
            for _ in stream:
                r, took = timed_get(server.url + "/metrics")
                assert took < 1.0
        assert time.monotonic() - began < STEP_TIMEOUT + 3
        assert error.value.code == "engine_dead"
        assert "past step_timeout=3 s: a rank or a collective is hung" in server.log.read_text()
        health, took = timed_get(server.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead" and took < 1.0
        r, took = timed_get(server.url + "/metrics")
        assert r.status_code == 200 and took < 1.0
        assert stop(server) == 0  # stayed up until told to stop
        assert_all_gone(tree)
        assert not semaphores() - before  # the killed core's group took its resource tracker along
    finally:
        stop(server)


def test_dp2_tp2_answers_as_one_engine_and_kill_9_of_the_server_takes_every_process(llama_dir, tmp_path, reference):
    server = start(tmp_path, "dp2tp2", llama_dir, *FLAGS, "-dp", "2", "-tp", "2", "--data-parallel-routing", "load")
    try:
        tree = descendants(server.proc.pid)
        assert len(cores_of(server)) == 2
        assert sum("spawn_main" in cmd for cmd in tree.values()) >= 2  # a worker per core
        assert greedy_texts(server) == reference
        server.proc.kill()  # the cores die with it (parent-death signal), their workers with them
        server.proc.wait()
        assert_all_gone(tree)
    finally:
        stop(server)


def test_vllms_process_flags_one_rank_alone_and_the_engine_in_the_server(llama_dir, tmp_path, reference):
    """--data-parallel-rank 1 of -dp 2 (external load balancing) runs that rank's core alone;
    --disable-frontend-multiprocessing steps the engine in a thread of the server's process."""
    for name, flags, cores in (("rank1", ("-dp", "2", "--data-parallel-rank", "1"), 1),
                               ("in-process", ("--disable-frontend-multiprocessing",), 0)):
        server = start(tmp_path, name, llama_dir, *FLAGS, *flags)
        try:
            tree = descendants(server.proc.pid)
            assert sum("core_process" in cmd for cmd in tree.values()) == cores, tree
            assert greedy_texts(server) == reference
            assert stop(server) == 0
            assert_all_gone(tree)
        finally:
            stop(server)
    assert "engine core 1 (pid" in (tmp_path / "rank1.log").read_text()  # named by its data-parallel rank


def idle_launch(tmp_path, *command: str):
    """A CoreLaunch whose 'core' is ``command`` (no engine) and the address of its inbox."""
    from modserve.server.core_launch import CoreLaunch

    context = zmq.Context()
    inbox, outbox, beats = context.socket(zmq.PUSH), context.socket(zmq.PULL), context.socket(zmq.PULL)
    for name, sock in (("inbox", inbox), ("outbox", outbox), ("beats", beats)):
        sock.bind(f"ipc://{tmp_path}/{name}")
    proc = subprocess.Popen([sys.executable, "-c", *command], start_new_session=True)
    return CoreLaunch(0, proc, context, inbox, outbox, beats, str(tmp_path / "run")), f"ipc://{tmp_path}/inbox"


def test_start_reaches_a_core_whose_inbox_connects_after_its_hello(tmp_path):
    """The core's Hello comes on the outbox, its own connection: Start must wait for the inbox's."""
    from modserve.engine import core_protocol as p

    launch, inbox = idle_launch(tmp_path, "import time; time.sleep(60)")
    received: list = []

    def late_core() -> None:
        time.sleep(0.5)
        sock = launch.context.socket(zmq.PULL)
        sock.connect(inbox)
        if sock.poll(5000):
            received.append(p.decode_to_core(sock.recv()))
        sock.close(linger=0)

    reader = threading.Thread(target=late_core)
    reader.start()
    try:
        launch.start()
    finally:
        reader.join()
        launch.kill()
        launch.close()
    assert [type(m) for m in received] == [p.Start]


def test_start_fails_when_the_core_ends_before_it_connects(tmp_path):
    from modserve.server.core_launch import EngineStartError

    launch, _ = idle_launch(tmp_path, "raise SystemExit(3)")
    try:
        with pytest.raises(EngineStartError, match="exited with code 3 while connecting"):
            launch.start()
    finally:
        launch.kill()
        launch.close()


def test_a_core_imports_its_engine_before_start_and_reports_a_failed_import_after_it(llama_dir, tmp_path,
                                                                                   monkeypatch):
    """The engine's imports run between Hello and Start (while the server still imports its own);
    one that fails is still the Failed answer to Start, naming the import's error."""
    from modserve.core.config import EngineConfig
    from modserve.engine import core_protocol as p
    from modserve.server.core_launch import EngineStartError, launch_core

    shadow = tmp_path / "shadow" / "transformers"
    shadow.mkdir(parents=True)
    marker = tmp_path / "imported"
    (shadow / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('x')\n"
                                        "raise ImportError('planted: transformers will not import')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]))
    launch = launch_core(EngineConfig(model=llama_dir, num_kv_blocks=64, max_model_len=256), 0)
    try:
        launch.wait_for((p.Hello,), "starting")
        assert wait_until(marker.exists, timeout=60)  # no Start sent yet
        launch.start()
        with pytest.raises(EngineStartError, match="planted: transformers will not import"):
            launch.wait_for((p.Ready,), "building its engine")
        assert marker.read_text() == "xx"  # tried before Start, and again by the build
    finally:
        launch.kill()
        launch.close()


def test_a_core_reads_its_checkpoints_config_before_start(llama_dir, tmp_path, monkeypatch):
    """Before Start a core imports its engine and its checkpoint's config class (transformers'
    model-loading modules come with it): a build after Start has neither left to import."""
    from modserve.core.config import EngineConfig
    from modserve.engine import core_protocol as p
    from modserve.server.core_launch import launch_core

    seen, hooks = tmp_path / "imported", tmp_path / "hooks"
    hooks.mkdir()
    wanted = ("modserve.engine.engine", "transformers.models.llama.configuration_llama")
    (hooks / "sitecustomize.py").write_text(  # the core's modules, written down as they appear
        "import sys, threading, time\n"
        "def watch():\n"
        f"    while not all(m in sys.modules for m in {wanted!r}):\n"
        "        time.sleep(0.05)\n"
        f"    open({str(seen)!r}, 'w').write('both')\n"
        "threading.Thread(target=watch, daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    launch = launch_core(EngineConfig(model=llama_dir, num_kv_blocks=64, max_model_len=256), 0)
    try:
        launch.wait_for((p.Hello,), "starting")
        assert wait_until(seen.exists, timeout=60)  # no Start sent
    finally:
        launch.kill()
        launch.close()


@pytest.mark.parametrize("model", ["llama", "demo"])
def test_serve_starts_its_engine_core_before_importing_torch(llama_dir, model):
    """``modserve serve`` spawns its cores before torch, transformers and the app import, so the
    cores' imports and the server's run at once; the demo's start plan (which kernels are built)
    imports none of them either."""
    argv = ["serve", "--num-kv-blocks", "64"] + ([llama_dir] if model == "llama" else [])
    code = f"""
import sys
from modserve.server import core_launch

def launch_cores(configs, first_rank=0):
    print("heavy at launch:", sorted(m for m in ("torch", "transformers", "modserve.server.app") if m in sys.modules))
    raise SystemExit(0)

core_launch.launch_cores = launch_cores
from modserve.cli import main
main({argv!r})
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "heavy at launch: []" in out.stdout, out.stdout + out.stderr


def test_the_front_ends_tokenizer_loads_while_the_core_builds(llama_dir, monkeypatch):
    """The output processor's tokenizer (transformers' first import in the server) loads before
    the server waits for Ready, not after it: a server start waits for the slower of the two."""
    from modserve.core.config import EngineConfig
    from modserve.server import engine_process
    from modserve.server.core_launch import CoreLaunch
    from modserve.server.engine_process import start_engine_processes

    events: list[str] = []
    tokenizer, wait_for = engine_process.Tokenizer, CoreLaunch.wait_for
    monkeypatch.setattr(engine_process, "Tokenizer", lambda *a: events.append("tokenizer") or tokenizer(*a))
    monkeypatch.setattr(CoreLaunch, "wait_for",
                        lambda self, kinds, what: events.append(kinds[0].__name__) or wait_for(self, kinds, what))
    (engine,) = start_engine_processes([EngineConfig(model=llama_dir, num_kv_blocks=64, max_model_len=256)])
    try:
        assert events == ["tokenizer", "Hello", "Ready"]
    finally:
        engine.shutdown_engine()
    assert not alive(engine.pid)


def test_a_tokenizer_that_does_not_load_fails_the_start_and_ends_the_core(llama_dir, tmp_path):
    from modserve.core.config import EngineConfig
    from modserve.server.engine_process import start_engine_processes

    before = set(descendants(os.getpid()))
    with pytest.raises(ValueError, match="tokenizer"):  # an empty folder: transformers' own error
        start_engine_processes([EngineConfig(model=llama_dir, tokenizer=str(tmp_path), num_kv_blocks=64,
                                             max_model_len=256)])
    assert set(descendants(os.getpid())) <= before  # the core started before the tokenizer was read: killed
