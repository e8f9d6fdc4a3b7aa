"""`modserve serve` with no arguments (what `make serve` runs) makes the demo model on a fresh
cache, becomes healthy, says how to query it, and answers the openai client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_no_arguments_serves_the_demo_model(tmp_path):
    # A fresh user cache, as on a new machine (unless the test cache is kept between runs).
    cache = os.environ.get("MODSERVE_TEST_CACHE")
    xdg = os.path.join(cache, "xdg") if cache else str(tmp_path / "xdg")
    port = _free_port()
    log = tmp_path / "demo.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "modserve", "serve", "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "XDG_CACHE_HOME": xdg})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["modserve-demo"]
        r = client.chat.completions.create(model="modserve-demo", max_tokens=4,
                                           messages=[{"role": "user", "content": "Hello"}])
        assert r.usage.completion_tokens >= 1
        time.sleep(0.2)  # the banner is printed right after the socket is bound
        text = log.read_text()
        assert f"curl {url}/v1/completions" in text and "from openai import OpenAI" in text
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) in (0, -signal.SIGINT, 130)
