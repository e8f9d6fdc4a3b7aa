"""Schemathesis against a real `modserve serve`: every response it provokes must be one
the server's /openapi.json declares (status, content type, headers, body schema),
and none may be a 5xx.

A bounded run: a fixed seed and a few dozen generated examples per operation on top of
schemathesis's boundary-value (coverage) cases, about half a minute here. Set
MODSERVE_FUZZ_SEED to explore other inputs. The engine lives in the server process,
so the KV-leak check goes through /metrics.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator

import httpx
import pytest
from server_process import Server, launch, stop, wait_for, wait_healthy

pytest.importorskip("schemathesis", reason="the test extra installs it")

MODEL = "tiny-llama"
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "response_headers_conformance")
EXAMPLES_PER_OPERATION = 50
SEED = os.environ.get("MODSERVE_FUZZ_SEED", "20240501")
RUN_TIMEOUT = 360  # seconds; the run takes well under a minute when nothing hangs


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory) -> Iterator[Server]:
    # A short context and a small cache keep every generated request short: a request without
    # max_tokens generates up to the context's end, most of the engine's work in this run. 64
    # tokens still hold every prompt the run generates (at 128 the same requests reach the engine).
    s = launch(tmp_path_factory.mktemp("fuzz"), "fuzz", "--model", llama_dir, "--served-model-name", MODEL,
               "--max-model-len", "64", "--num-kv-blocks", "64")
    try:
        wait_healthy(s)
        yield s
    finally:
        stop(s)


def test_schema_declares_the_real_errors_and_streams(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            declared = op["responses"]
            assert "422" not in declared, (method, path)
            must = {"500", "503"} | ({"400", "404"} if method == "post" else set())
            assert must <= set(declared), (method, path, sorted(declared))
            for status in must:
                assert declared[status]["content"]["application/json"]["schema"] == error
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(schema["paths"][path]["post"]["responses"]["200"]["content"]) == {
            "application/json", "text/event-stream"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_responses_conform_to_the_schema(server, tmp_path):
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
        "--checks", ",".join(CHECKS),
        "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", str(EXAMPLES_PER_OPERATION),
        "--seed", SEED,
        "--workers", "2",  # the server's engine thread gets the other core's share
        "--request-timeout", "60",
        "--generation-database", "none",  # no .hypothesis folder, and no replays of old runs
        "--output-sanitize", "false",  # it would hide fields named like max_tokens in the report
        "--no-color",
    ]
    # Loopback only: a proxy from the environment must not see these requests.
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    try:
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as e:  # a hung request: show how far it got
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        pytest.fail(f"schemathesis ran past {RUN_TIMEOUT} s\n\n{out}\n--- server log (tail) ---\n"
                    f"{_log_tail(server)}", pytrace=False)
    if run.returncode != 0:
        pytest.fail(f"schemathesis failed (exit {run.returncode}); command: {' '.join(cmd)}\n\n"
                    f"{run.stdout}\n{run.stderr}\n--- server log (tail) ---\n{_log_tail(server)}",
                    pytrace=False)
    assert server.proc.poll() is None, _log_tail(server)


def test_every_block_is_free_after_fuzzing(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_for(lambda: server.metrics()["modserve_kv_blocks_used"] == 0)
    m = server.metrics()
    assert m["modserve_kv_blocks_free"] == m["modserve_kv_blocks_total"]
    assert m["modserve_num_requests_running"] == m["modserve_num_requests_waiting"] == 0


def _log_tail(server: Server, lines: int = 200) -> str:
    return "\n".join(server.log.read_text(errors="replace").splitlines()[-lines:])
