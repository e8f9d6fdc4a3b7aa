"""The ``llama.cpp`` baseline of ``bench latency``: how it drives llama-bench and the converter.

A fake llama.cpp tree (a ``llama-bench`` that checks its arguments and prints llama-bench's
JSON records, a ``convert_hf_to_gguf.py`` that writes a file) checks the commands and the
arithmetic without a build. With ``MODSERVE_LLAMA_CPP_DIR`` set to a real tree with a built
llama-bench, the last test runs the real thing on the tiny checkpoint.
"""

from __future__ import annotations

import os
import stat
import textwrap
from pathlib import Path

import pytest

from modserve.bench.llamacpp_baseline import LlamaCppRunner, LlamaCppUnavailable, find_tools
from modserve.bench.workloads import BenchRequest
from modserve.cli import main

FAKE_BENCH = '''#!{python}
import argparse, json, sys
ap = argparse.ArgumentParser()
for flag in ("-m", "-p", "-n", "-d", "-t", "-r", "-o"):
    ap.add_argument(flag)
a = ap.parse_args()
assert a.r == "1" and a.o == "json", (a.r, a.o)
open({log!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
p, n, d = int(a.p), int(a.n), int(a.d)
assert (p > 0) != (n > 0), "one test per run: pp or tg"
ts = 500.0 if p else 80.0 - d / 16  # tok/s: prompt processing, or generation slower with depth
print(json.dumps([{{"build_commit": "fake", "model_type": "llama ?B BF16", "n_threads": int(a.t),
                   "n_prompt": p, "n_gen": n, "n_depth": d, "avg_ts": ts, "stddev_ts": 0.0}}]))
'''

# The converter's shape as gguf_convert relies on: conversion.base.TextModel.get_vocab_base_pre,
# which refuses a tokenizer it has no hash for; the fake writes the name it got into the "GGUF".
FAKE_CONVERTER = '''import sys
from conversion.base import TextModel
args = sys.argv[1:]
out = args[args.index("--outfile") + 1]
pre = TextModel().get_vocab_base_pre(None)
open(out, "w").write("GGUF " + args[args.index("--outtype") + 1] + " of " + args[0] + ", pre " + pre)
'''
FAKE_BASE = '''class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")
'''


@pytest.fixture
def fake_tree(tmp_path) -> tuple[Path, Path]:
    """(a llama.cpp tree with a fake llama-bench and converter, the file llama-bench logs its arguments to)."""
    tree, log = tmp_path / "llama.cpp", tmp_path / "calls.log"
    (tree / "build" / "bin").mkdir(parents=True)
    (tree / "gguf-py").mkdir()
    bench = tree / "build" / "bin" / "llama-bench"
    import sys

    bench.write_text(FAKE_BENCH.format(python=sys.executable, log=str(log)))
    bench.chmod(bench.stat().st_mode | stat.S_IXUSR)
    (tree / "convert_hf_to_gguf.py").write_text(textwrap.dedent(FAKE_CONVERTER))
    (tree / "conversion").mkdir()
    (tree / "conversion" / "__init__.py").write_text("")
    (tree / "conversion" / "base.py").write_text(FAKE_BASE)
    return tree, log


def test_latency_runs_pp_then_tg_at_the_prompts_depth(fake_tree, tmp_path):
    tree, log = fake_tree
    bench, _ = find_tools(str(tree), None)
    gguf = tmp_path / "m.gguf"
    gguf.write_text("x")
    run = LlamaCppRunner(bench, gguf, threads=2).latency(BenchRequest(None, list(range(128)), 64))
    assert log.read_text().splitlines() == [f"-m {gguf} -p 128 -n 0 -d 0 -t 2 -r 1 -o json",
                                            f"-m {gguf} -p 0 -n 64 -d 128 -t 2 -r 1 -o json"]
    assert run.ttft == pytest.approx(128 / 500.0)
    assert run.tpot == pytest.approx(1 / 72.0)  # 80 - 128 / 16 tok/s at depth 128
    assert run.e2el == pytest.approx(128 / 500.0 + 63 / 72.0)


def test_bench_latency_prints_the_ratio_from_one_interleaved_run(fake_tree, llama_dir, tmp_path, capsys,
                                                                monkeypatch):
    tree, log = fake_tree
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where the converted GGUF goes
    rc = main(["bench", "latency", "--model", llama_dir, "--dtype", "bfloat16", "--baseline", "llama.cpp",
               "--llama-cpp-dir", str(tree), "--input-len", "16", "--output-len", "8", "--repeats", "3",
               "--warmups", "0", "--threads", "1", "--num-kv-blocks", "64", "--max-model-len", "256"])
    out = capsys.readouterr().out
    assert rc == 0, out
    ggufs = list((tmp_path / "cache").rglob("*.gguf"))
    assert len(ggufs) == 1 and ggufs[0].name.endswith("-f32.gguf")  # the checkpoint stores float32
    assert ggufs[0].read_text() == f"GGUF f32 of {llama_dir}, pre gpt-2"  # our tokenizer is GPT-2's ByteLevel
    assert len(log.read_text().splitlines()) == 2 * 3  # pp and tg per repeat, nothing for warm-ups
    assert "baseline llama.cpp:" in out and "build_commit fake" in out
    ratio = next(line for line in out.splitlines() if line.startswith("modserve / llama.cpp: decode tok/s"))
    assert ratio.endswith("x")
    assert "tg8 after 16 tokens of context" in out


def test_a_tokenizer_that_is_not_gpt2_byte_level_is_still_refused(fake_tree, llama_dir, tmp_path):
    import json
    import shutil

    from modserve.bench.llamacpp_baseline import convert

    tree, _ = fake_tree
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "_"}
    (model / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(LlamaCppUnavailable, match="BPE pre-tokenizer was not recognized"):
        convert(str(model), tree / "convert_hf_to_gguf.py", "bf16", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.tmp").exists()


def test_a_missing_llama_bench_is_an_error_that_says_what_to_pass(llama_dir, tmp_path, capsys):
    args = ["bench", "latency", "--model", llama_dir, "--baseline", "llama.cpp", "--input-len", "8",
            "--output-len", "4", "--repeats", "1", "--threads", "1", "--num-kv-blocks", "32", "--max-model-len", "256"]
    assert main(args) == 2
    assert "--llama-cpp-dir DIR" in capsys.readouterr().err
    assert main([*args, "--llama-bench", str(tmp_path / "nope")]) == 2
    assert f"llama-bench not found or not executable: {tmp_path / 'nope'}" in capsys.readouterr().err


def test_no_gguf_and_no_converter_is_an_error(fake_tree, llama_dir, tmp_path, capsys, monkeypatch):
    tree, _ = fake_tree
    (tree / "convert_hf_to_gguf.py").unlink()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["bench", "latency", "--model", llama_dir, "--baseline", "llama.cpp",
                 "--llama-bench", str(tree / "build" / "bin" / "llama-bench"), "--input-len", "8",
                 "--output-len", "4", "--repeats", "1", "--threads", "1", "--num-kv-blocks", "32",
                 "--max-model-len", "256"]) == 2
    assert "no GGUF to benchmark: pass --gguf PATH" in capsys.readouterr().err
    with pytest.raises(LlamaCppUnavailable, match="no GGUF at"):
        LlamaCppRunner(tree / "build" / "bin" / "llama-bench", tmp_path / "missing.gguf", 1)


@pytest.mark.skipif(not os.environ.get("MODSERVE_LLAMA_CPP_DIR"), reason="needs a llama.cpp tree with llama-bench")
def test_real_llama_bench(llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["bench", "latency", "--model", llama_dir, "--dtype", "bfloat16", "--baseline", "llama.cpp",
                 "--llama-cpp-dir", os.environ["MODSERVE_LLAMA_CPP_DIR"], "--input-len", "16", "--output-len", "8",
                 "--repeats", "1", "--warmups", "0", "--threads", "1", "--num-kv-blocks", "64",
                 "--max-model-len", "256"]) == 0
    assert "modserve / llama.cpp: decode tok/s" in capsys.readouterr().out
