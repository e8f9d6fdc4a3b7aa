"""The ``llama.cpp`` baseline: an installed ``llama-bench``, on a GGUF of the same checkpoint.

Nothing is installed or built here. The user points at a llama.cpp tree
(``--llama-cpp-dir``: its ``convert_hf_to_gguf.py``, ``gguf-py/`` and a built
``build/bin/llama-bench``) or at the two pieces (``--llama-bench``, ``--gguf``). Without a
GGUF, the checkpoint is converted once with llama.cpp's own converter (through
:mod:`.gguf_convert`, which names a GPT-2-style tokenizer of our own ``gpt-2``) at the weight
precision asked for (``--gguf-outtype``, default: the engine's dtype) and kept in the user
cache, keyed by the checkpoint's digest.

Per repeat, two ``llama-bench`` runs of one repetition each, as its own ``pp``/``tg`` tests
measure: prompt processing of ``input_len`` tokens (TTFT = input_len / pp tok/s) and
generation of ``output_len`` tokens after ``input_len`` tokens of context (``-d``), so the
decode step reads a context as long as modserve's does (TPOT = 1 / tg tok/s). llama-bench
times its own work, after loading the model and a warm-up, so loading never counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from modserve.bench.offline import LatencyRun
from modserve.bench.workloads import BenchRequest

CONVERT = Path(__file__).with_name("gguf_convert.py")  # the converter, naming our tokenizer's pre-tokenizer


class LlamaCppUnavailable(RuntimeError):
    """No llama-bench, no converter, or a conversion that failed."""


def find_tools(llama_cpp_dir: str | None, llama_bench: str | None) -> tuple[Path, Path | None]:
    """(llama-bench, convert_hf_to_gguf.py or None) from the flags; errors say what is missing."""
    tree = Path(llama_cpp_dir) if llama_cpp_dir else None
    bench = Path(llama_bench) if llama_bench else (tree / "build" / "bin" / "llama-bench" if tree else None)
    if bench is None:
        raise LlamaCppUnavailable("the llama.cpp baseline needs --llama-cpp-dir DIR (a llama.cpp tree with "
                                  "build/bin/llama-bench) or --llama-bench PATH; the benchmark builds nothing itself")
    if not (bench.is_file() and os.access(bench, os.X_OK)):
        raise LlamaCppUnavailable(f"llama-bench not found or not executable: {bench} (build it in the llama.cpp "
                                  "tree: cmake -B build && cmake --build build --target llama-bench)")
    converter = tree / "convert_hf_to_gguf.py" if tree else None
    return bench, converter if converter and converter.is_file() else None


def gguf_path(model_dir: str, outtype: str, cache_dir: Path) -> Path:
    from modserve.runner.loader import checkpoint_digest

    return cache_dir / f"{Path(model_dir).name}-{checkpoint_digest(model_dir)[:16]}-{outtype}.gguf"


def convert(model_dir: str, converter: Path | None, outtype: str, out: Path) -> Path:
    """``out``, converting ``model_dir`` with llama.cpp's converter unless it is there already."""
    if out.exists():
        return out
    if converter is None:
        raise LlamaCppUnavailable("no GGUF to benchmark: pass --gguf PATH, or --llama-cpp-dir DIR of a tree "
                                  "with convert_hf_to_gguf.py to convert the checkpoint")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    print(f"converting {model_dir} to GGUF ({outtype}) with {converter} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, str(CONVERT), str(converter), model_dir, "--outtype", outtype,
                           "--outfile", str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise LlamaCppUnavailable(f"{converter.name} failed on {model_dir}:\n{done.stderr[-2000:]}")
    tmp.rename(out)
    return out


class LlamaCppRunner:
    """Single-stream latency from ``llama-bench``; the interface :func:`single_stream` drives."""

    name = "llama.cpp"
    latency_method = "llama-bench"

    def __init__(self, llama_bench: Path, gguf: Path, threads: int) -> None:
        if not gguf.is_file():
            raise LlamaCppUnavailable(f"no GGUF at {gguf}")
        self.llama_bench, self.gguf, self.threads = llama_bench, gguf, threads
        self.info: dict[str, Any] = {}

    def bench(self, n_prompt: int, n_gen: int, depth: int) -> dict[str, Any]:
        """One llama-bench test, one repetition: its JSON record."""
        cmd = [str(self.llama_bench), "-m", str(self.gguf), "-p", str(n_prompt), "-n", str(n_gen),
               "-d", str(depth), "-t", str(self.threads), "-r", "1", "-o", "json"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise LlamaCppUnavailable(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        records = json.loads(done.stdout)
        if len(records) != 1:
            raise LlamaCppUnavailable(f"llama-bench printed {len(records)} results for one test: {done.stdout[:500]}")
        self.info = records[0]
        return records[0]

    def latency(self, request: BenchRequest) -> LatencyRun:
        n_in, n_out = request.prompt_len, request.output_len
        prompt_tok_s = self.bench(n_in, 0, 0)["avg_ts"]
        gen_tok_s = self.bench(0, n_out, n_in)["avg_ts"]
        ttft, tpot = n_in / prompt_tok_s, 1.0 / gen_tok_s
        return LatencyRun(ttft, tpot, ttft + (n_out - 1) * tpot)

    def run(self, requests: list[BenchRequest]) -> Any:  # warm_up's call: llama-bench warms up itself
        return None

    def describe(self) -> str:
        keys = ("build_commit", "build_number", "model_type", "model_size", "n_threads", "cpu_info")
        got = ", ".join(f"{k} {self.info[k]}" for k in keys if k in self.info)
        return f"baseline llama.cpp: {self.llama_bench} on {self.gguf.name}" + (f" ({got})" if got else "")

    def close(self) -> None:
        pass
