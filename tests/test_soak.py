"""scripts/soak_server.py, CI-sized: 8 s of 16 streaming clients against a real server process,
with hang-ups and client timeouts, leave no failed request, no running or waiting sequence and
no KV block in use; and the same beside hostile clients (scripts/soak_hostile.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak_server.py"


def run_soak(llama_dir: str, tmp_path: Path, *flags: str) -> dict:
    """The script's report, after its own checks passed."""
    report_path, log = tmp_path / "soak.json", tmp_path / "server.log"
    cmd = [sys.executable, str(SCRIPT), "--model", llama_dir, "--num-threads", "1", *flags,
           "--log-file", str(log), "--out", str(report_path)]
    # Generous bounds for a busy 2-core machine: the script bounds every phase itself (startup,
    # load, drain, stop), this only catches a hang.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    context = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}\n" + (
        f"server log:\n{log.read_text(errors='replace')[-4000:]}" if log.exists() else "")
    assert proc.returncode == 0, context
    report = json.loads(report_path.read_text())
    assert report["ok"] and all(c["ok"] for c in report["checks"]), context
    return report


def test_soak_leaves_the_server_idle_and_whole(llama_dir, tmp_path):
    # 8 s of 16 clients is over a hundred requests even on a busy 2-core machine: every kind (chat
    # and completion, n=2, seeds, hang-ups, client timeouts) many times over.
    report = run_soak(llama_dir, tmp_path, "--duration", "8", "--concurrency", "16", "--warmup", "1",
                      "--max-model-len", "256", "--num-kv-blocks", "128")
    load, after = report["load"], report["metrics_after"]
    assert load["failures"] == 0 and not load["errors"], load
    assert load["completed"] > 0 and load["disconnected"] > 0, load
    assert load["completion_tokens"] > 0, load
    assert after["running"] == 0 and after["waiting"] == 0, after
    assert after["kv_blocks_used"] == 0 and after["kv_blocks_total"] == 128, after
    assert report["server"]["stop"]["killed"] is False, report["server"]


def test_soak_beside_hostile_clients(llama_dir, tmp_path):
    """Grammar bombs, fan-out past the bound, huge answers, thousands of stop strings, slow
    readers and abort storms beside 8 normal clients: every hostile request is refused, served
    within the bounds or cut off by the server, no normal one fails, and the server is idle
    and whole afterwards."""
    # 6 s per phase: time for the hostile clients to send every kind between them, the slow reader
    # first (held 6 s, past the 1.5 s stall timeout).
    report = run_soak(llama_dir, tmp_path, "--duration", "6", "--concurrency", "8", "--warmup", "1",
                      "--max-model-len", "1024", "--num-kv-blocks", "256", "--hostile-workers", "3",
                      "--slow-reader-hold", "6", "--max-victim-slowdown", "10",
                      "--server-arg=--stream-stall-timeout", "--server-arg=1.5")
    hostile = report["hostile"]["hostile"]
    assert hostile["num_failures"] == 0, hostile
    assert hostile["refused"].get("grammar_bomb", 0) > 0 and hostile["refused"].get("many_stops", 0) > 0, hostile
    assert hostile["cut"].get("slow_reader", 0) > 0, hostile  # the server ended a stream nobody read
    assert report["server_finished"].get("stalled", 0) > 0, report["server_finished"]
    assert report["hostile"]["victims"]["failures"] == 0 and report["hostile"]["victims"]["completed"] > 0
    after = report["metrics_after"]
    assert after["running"] == 0 and after["waiting"] == 0 and after["kv_blocks_used"] == 0, after
