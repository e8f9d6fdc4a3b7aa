"""scripts/step_python_time.py: its forward replay (``--replay``), and a run of the script on the
tiny model, so the figures in docs/benchmarks.md can be made again as the engine changes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from modserve.runner.messages import RunModel

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "step_python_time.py"


def load_script():
    spec = importlib.util.spec_from_file_location("step_python_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(num_tokens: int, max_query_len: int) -> RunModel:
    return RunModel(None, SimpleNamespace(num_tokens=num_tokens, max_query_len=max_query_len), [])


def test_replay_runs_prefills_and_each_sizes_first_decode_then_replays_that_decode():
    script = load_script()
    ran = []
    runner = SimpleNamespace(on_every_rank=lambda message: ran.append(message) or [f"logits of {len(ran)}"])
    script.replay_forward(runner, 0)
    prefill, one, one_again, two, prefill_again = step(32, 32), step(1, 1), step(1, 1), step(2, 1), step(32, 32)
    got = [runner.on_every_rank(m) for m in (prefill, one, one_again, two, prefill_again)]
    assert ran == [prefill, one, two, prefill_again]  # the second one-row decode was not run
    assert got == [["logits of 1"], ["logits of 2"], ["logits of 2"], ["logits of 3"], ["logits of 4"]]
    other = SimpleNamespace()  # a message that is not a step (AllocateKVCache, LoadKV) always runs
    runner.on_every_rank(other)
    assert ran[-1] is other


def test_the_script_times_each_phase_of_the_tiny_models_steps(tmp_path):
    out = tmp_path / "phases.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--batch-sizes", "1", "2", "--steps", "2",
                           "--rounds", "1", "--replay", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the forward replayed after a read of 1 MiB" in done.stdout
    (model, by_size), = json.loads(out.read_text()).items()
    assert sorted(by_size) == ["1", "2"]
    for phases in by_size.values():
        got = phases["input batch"]
        assert got["python"] > 0 and got["forward + logits"] > 0 and got["step"] > got["python"]
