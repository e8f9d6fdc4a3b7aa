"""scripts/soak_server.py, CI-sized: 20 s of 16 streaming clients against a real server process,
with hang-ups and client timeouts, leave no failed request, no running or waiting sequence and
no KV block in use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak_server.py"


def test_soak_leaves_the_server_idle_and_whole(llama_dir, tmp_path):
    report_path, log = tmp_path / "soak.json", tmp_path / "server.log"
    cmd = [sys.executable, str(SCRIPT), "--model", llama_dir, "--duration", "20", "--concurrency", "16",
           "--warmup", "3", "--num-threads", "1", "--max-model-len", "256", "--num-kv-blocks", "128",
           "--log-file", str(log), "--out", str(report_path)]
    # Generous bounds for a busy 2-core machine: startup, 23 s of load, the drain and the stop
    # take about 35 s alone; the script bounds every phase itself, this only catches a hang.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    context = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}\n" + (
        f"server log:\n{log.read_text(errors='replace')[-4000:]}" if log.exists() else "")
    assert proc.returncode == 0, context
    report = json.loads(report_path.read_text())
    assert report["ok"] and all(c["ok"] for c in report["checks"]), context

    load, after = report["load"], report["metrics_after"]
    assert load["failures"] == 0 and not load["errors"], load
    assert load["completed"] > 0 and load["disconnected"] > 0, load
    assert load["completion_tokens"] > 0, load
    assert after["running"] == 0 and after["waiting"] == 0, after
    assert after["kv_blocks_used"] == 0 and after["kv_blocks_total"] == 128, after
    assert report["server"]["stop"]["killed"] is False, report["server"]
