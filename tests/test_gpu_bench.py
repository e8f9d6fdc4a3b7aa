"""scripts/gpu_bench.py in its --smoke mode, on CPU: the figures a lent GPU will produce have
the keys and the kinds of numbers the summary reads, so the script cannot rot unnoticed where
no GPU runs it (the Triton backend runs in its interpreter, TRITON_INTERPRET from conftest)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or importlib.util.find_spec("modserve.attention_backends.triton_attention") is None,
    reason="the triton package or modserve's triton attention backend is missing")


def run_bench(out: Path, *args: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_kernels_smoke_measures_triton_against_sdpa(tmp_path):
    fig = run_bench(tmp_path / "figures.json", "kernels")
    k = fig["kernels"]
    assert positive(k["copy_bandwidth"]["tb_s"])
    cases = [*k["prefill"].values(), *k["decode"].values()]
    assert len(k["prefill"]) == 1 and len(k["decode"]) == 1
    for case in cases:
        assert "triton_error" not in case, case["triton_error"]
        assert positive(case["triton_ms"]) and positive(case["sdpa_ms"]) and case["sdpa_call"].startswith("flash")
        assert case["rel_err"] < (1e-4 if k["dtype"] == "torch.float32" else 2e-2)  # CPU: float32
        assert positive(case["tflop_s"]["triton"]) and positive(case["hbm_fraction"]["sdpa"])


def test_decode_smoke_runs_every_engine_and_the_baseline(tmp_path):
    out = tmp_path / "figures.json"
    fig = run_bench(out, "decode")
    d = fig["decode"]
    assert positive(d["bandwidth_tb_s"]) and positive(d["model"]["weight_bytes_read_per_step"])
    assert not Path(d["model"]["dir"]).exists()  # the checkpoint is removed after
    assert d["hf_static_compiled"] == {"skipped": "smoke: no torch.compile"}
    for name in ("triton_graphs", "triton_eager", "paged"):
        run = d[name]
        assert "error" not in run, run["error"]
        graphs = name == "triton_graphs" and torch.cuda.is_available()  # the CPU captures none
        assert run["graphs"]["type"] == ("DecodeGraphs" if graphs else "method")
        assert any(line.startswith("compile auto") for line in run["engine_log"])
        for batch in ("b1", "b2"):  # single-stream and the smoke batch
            r = run[batch]
            assert {"tok_s", "ms_per_step", "ceiling_tok_s", "fraction"} <= set(r)
            assert all(math.isfinite(r[key]) for key in ("tok_s", "ceiling_tok_s", "fraction"))
    # Interpreted Triton steps take tens of ms: a difference of two runs stays clear of the noise.
    assert positive(d["triton_graphs"]["b1"]["tok_s"]) and positive(d["triton_eager"]["b2"]["tok_s"])
    hf = d["hf_static_eager"]
    assert "error" not in hf, hf["error"]
    assert {"tok_s", "ceiling_tok_s", "fraction"} <= set(hf)
    # The summary reads these figures without failing.
    summary = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "summary"], capture_output=True,
                             text=True, timeout=60)
    assert summary.returncode == 0 and "triton_graphs: b1:" in summary.stdout, summary.stderr


def test_record_reads_pytest_counts_from_a_cut_off_log(tmp_path):
    log = tmp_path / "cuda_tests.out"
    log.write_text("tests/test_cuda.py::test_a PASSED [ 10%]\ntests/test_cuda.py::test_b[x] FAILED [ 20%]\n"
                   "tests/test_cuda.py::test_c SKIPPED (needs) [ 30%]\n")
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "record", "cuda_tests", "124", str(log),
                           "--seconds", "150"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    fig = json.loads(out.read_text())
    assert fig["cuda_tests"]["passed"] == 1 and fig["cuda_tests"]["failed"] == 1 and fig["cuda_tests"]["skipped"] == 1
    assert fig["cuda_tests"]["not_passed"] == ["tests/test_cuda.py::test_b[x] FAILED"]
    assert fig["failed"]["cuda_tests"]["timed_out"] and fig["phase_seconds"]["cuda_tests"] == 150
