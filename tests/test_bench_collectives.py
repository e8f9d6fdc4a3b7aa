"""``modserve bench collectives`` on real gloo process groups, and the parallelism arithmetic of ``modserve plan``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from modserve.bench import collectives, plan
from modserve.cli import main

# A Llama-3.2-1B-like shape: TP=1 fits an H100, so the verdict is decided by the collectives' time.
SHAPE = {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "torch_dtype": "bfloat16",
         "tie_word_embeddings": True}


def _curve(path: Path, latency_us: float, world_size: int = 2) -> Path:
    """A bench collectives --json file whose all-reduce takes latency_us at every measured size."""
    meta = {"machine": "test", "date": "2026-01-01T00:00:00", "backend": "gloo", "world_size": world_size,
            "dtype": "float32"}
    results = [{"op": "all_reduce", "bytes": b, "median_us": latency_us} for b in (4096, 1 << 20, 4 << 20)]
    path.write_text(json.dumps({"meta": meta, "results": results}))
    return path


# -- bench collectives ---------------------------------------------------------------------------
def test_sizes_and_bus_bandwidth_by_hand():
    assert collectives.message_sizes(1024, 4096) == [1024, 2048, 4096]
    assert collectives.message_sizes(4096, 64 << 20, factor=4)[-1] == 64 << 20
    assert [collectives.parse_bytes(s) for s in ("4096", "4K", "64MiB", "1.5k")] == [4096, 4096, 64 << 20, 1536]
    with pytest.raises(ValueError):
        collectives.parse_bytes("four")
    assert collectives.bus_factor("all_reduce", 2) == 1.0 and collectives.bus_factor("all_reduce", 8) == 1.75
    assert collectives.bus_factor("all_gather", 4) == 0.75
    assert collectives.rounded(1000, 4, 2) == 1000 and collectives.rounded(1001, 4, 2) == 1000
    r = collectives.result("all_reduce", 8000, "float32", 4, [1e-3, 2e-3, 3e-3])
    assert r.median_us == pytest.approx(2000) and r.algbw == pytest.approx(8000 / 2e-3 / 1e9)
    assert r.busbw == pytest.approx(r.algbw * 2 * 3 / 4)
    points = [(1000, 1e-5), (2000, 3e-5)]  # linear between, a floor below, bandwidth above
    assert collectives.interpolate(points, 1500) == pytest.approx(2e-5)
    assert collectives.interpolate(points, 10) == 1e-5 and collectives.interpolate(points, 4000) == pytest.approx(6e-5)


def test_bench_collectives_gloo_world_size_2(tmp_path, capsys):
    out, png = tmp_path / "coll.json", tmp_path / "coll.png"
    rc = main(["bench", "collectives", "--world-size", "2", "--min-bytes", "1K", "--max-bytes", "4K",
               "--gather-bytes", "2K", "--repeats", "4", "--warmups", "1", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "backend gloo, world size 2" in text and "busbw (GB/s)" in text and f"wrote {out}" in text
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["backend"] == "gloo" and meta["world_size"] == 2 and meta["repeats"] == 4 and meta["machine"]
    assert meta["date"][:2] == "20" and meta["dtype"] == "float32"
    rs = data["results"]
    assert [(r["op"], r["bytes"]) for r in rs] == [("all_reduce", 1024), ("all_reduce", 2048), ("all_reduce", 4096),
                                                   ("all_gather", 2048)]
    n = meta["world_size"]
    for r in rs:
        assert len(r["times_us"]) == 4 and all(t > 0 for t in r["times_us"])
        assert 0 < r["median_us"] <= r["p90_us"]
        assert r["algbw"] == pytest.approx(r["bytes"] / (r["median_us"] * 1e-6) / 1e9)
        factor = 2 * (n - 1) / n if r["op"] == "all_reduce" else (n - 1) / n
        assert r["busbw"] == pytest.approx(r["algbw"] * factor)
    assert png.stat().st_size > 1000
    # what plan reads back
    curve = plan.MeasuredCollectives.load(out)
    assert curve.world_size == 2 and curve.time("all_reduce", 1024, 2) == pytest.approx(rs[0]["median_us"] * 1e-6)


def test_bench_collectives_refuses_one_rank(capsys):
    assert main(["bench", "collectives", "--world-size", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


# -- plan: tensor parallelism's collectives ------------------------------------------------------
def test_plan_tp_allreduce_arithmetic_and_verdict(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(SHAPE))
    shape = plan.ModelShape.load(model)
    hw = plan.HARDWARE["h100"]
    p1, p2 = plan.plan(shape, hw, tp=1, context_len=512), plan.plan(shape, hw, tp=2, context_len=512)

    def verdict(latency_us: float) -> str:
        path = _curve(tmp_path / f"ar-{latency_us}.json", latency_us)
        rc = main(["plan", "--model", str(model), "--tp", "2", "--batch-size", "8", "--context-len", "512",
                   "--allreduce-json", str(path)])
        assert rc == 0
        out = capsys.readouterr().out
        # 2 all-reduces x hidden 2048 x 2 bytes per token per layer; at batch 8 each is 8 x 2048 x 2 = 32 KiB
        assert "2 all-reduces per layer x hidden 2048 x 2 B (bfloat16) = 8.0 KiB per token per layer" in out
        assert "batch 8: 33 all-reduces (2 per layer + embedding) of 32.0 KiB" in out
        # a flat curve: every all-reduce (and the all-gather, none measured) takes latency_us
        assert f"33 x {latency_us:,.1f} + {latency_us:,.1f} = {34 * latency_us:,.1f} us per step" in out
        assert f"measured: {path}" in out
        return next(line for line in out.splitlines() if line.startswith("verdict"))

    saved = plan.step_time(p1, 8) - plan.step_time(p2, 8)
    assert 100e-6 < saved < 2000e-6  # half of about 2.5 GB of weights read at 3.35 TB/s
    tiny, huge = verdict(0.5), verdict(10_000.0)
    assert "TP=2 worth it" in tiny and f"{saved * 1e6:,.1f} us saved" in tiny
    assert "TP=2 not worth it: all-reduce + all-gather 340,000.0 us per step" in huge

    c = plan.tp_comms(shape, p1, p2, plan.INTERCONNECTS["nvlink4"], batch=8)
    ar = 8 * 2048 * 2
    assert c.allreduce_s == pytest.approx(10e-6 + ar * 1.0 / 450e9)  # busbw factor 2(n-1)/n = 1 at n = 2
    gathered = 8 * plan.padded_vocab(128256, 2) * 2
    assert c.allgather_bytes == gathered and c.allgather_s == pytest.approx(10e-6 + gathered * 0.5 / 450e9)
    assert c.step_s == pytest.approx(plan.step_time(p2, 8) + 33 * c.allreduce_s + c.allgather_s)
    assert c.worth_it  # NVLink: 0.4 ms of collectives against ~0.8 ms of weight reads saved
    assert not plan.tp_comms(shape, p1, p2, plan.INTERCONNECTS["loopback-gloo"], batch=8).worth_it


def test_plan_tp_presets_pipeline_and_json(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(SHAPE))
    assert main(["plan", "--model", str(model), "--tp", "2", "--pp", "4", "--micro-batches", "6",
                 "--batch-size", "4", "--interconnect", "pcie4"]) == 0
    out = capsys.readouterr().out
    assert "pcie4 preset: 25 us + bytes / 25 GB/s busbw" in out
    assert "PP=4: 4 of 16 layers per stage" in out
    assert "hidden x 2 B (bfloat16) = 4.0 KiB per token across each of 3 stage boundaries; 16.0 KiB" in out
    assert "bubble          33.3% idle with 6 micro-batches in flight: (pp - 1) / (micro-batches + pp - 1) = 3 / 9" \
        in out

    assert main(["plan", "--model", str(model), "--tp", "2", "--json"]) == 0  # h100: NVLink 4 unless told
    data = json.loads(capsys.readouterr().out)
    assert data["tp_comms"]["interconnect"].startswith("nvlink4 preset") and "pipeline" not in data
    assert data["tp_comms"]["step_s"] == pytest.approx(data["tp_comms"]["step_s_compute"] + data["tp_comms"]["comms_s"])

    assert main(["plan", "--model", str(model)]) == 0  # TP=1, PP=1: the plan as before, nothing added
    out = capsys.readouterr().out
    assert "TP comms" not in out and "pipeline" not in out and out.startswith("hardware        h100 x1")

    shape = plan.ModelShape.load(model)
    p = plan.plan(shape, plan.HARDWARE["h100"])
    one = plan.pipeline(shape, p, 1)
    assert one.stage_weight_bytes == pytest.approx(p.weight_bytes) and one.bubble == 0
    uneven = plan.pipeline(shape, p, 3)  # 16 layers: 6 + 5 + 5
    assert uneven.layers_per_stage == 6 and math.isclose(uneven.bubble, 2 / 5)
