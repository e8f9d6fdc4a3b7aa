"""GPU figures for modserve: attention kernels and end-to-end decode, against their ceilings.

    python3 scripts/gpu_bench.py --out OUT/figures.json env|kernels|decode [--smoke] [--budget S]
    python3 scripts/gpu_bench.py --out OUT/figures.json record PHASE RC LOG --seconds S
    python3 scripts/gpu_bench.py --out OUT/figures.json summary

Each command merges its section into the JSON at --out and rewrites it (atomically) after
every measurement: a run killed by its timeout leaves what it had measured. A case that fails
records its error and the next one runs. ``scripts/gpu_check.sh`` runs them all on a lent GPU.

- kernels: the device-to-device copy bandwidth (the ceiling), then the Triton backend's
  ``attend`` against SDPA's flash kernel at Llama-3-8B attention shapes (32 q heads, 8 KV
  heads, head 128, bf16, blocks of 16): a causal prefill of one sequence, and decodes of
  B sequences x context C, each KV read once from HBM (the L2 is flushed before every timed call).
- decode: a random-weight Llama-3-8B-shaped model made on the GPU, then single-stream and
  batched decode tok/s of modserve (triton with CUDA graphs, eager, paged) and transformers'
  static-cache ``generate`` (compiled, and eager), each against the bandwidth roofline.

``--smoke``: tiny shapes, on CPU too (Triton's interpreter), so tests/test_gpu_bench.py keeps
this script from rotting where there is no GPU. Only ``record`` and ``summary`` import no torch.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import logging
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

GB = 1e9


@dataclass(frozen=True)
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int
    prefill_lens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    copy_bytes: int  # one side of the bandwidth copy
    model: dict[str, Any]  # LlamaConfig fields
    prompt_len: int
    single_out: int  # tokens timed single-stream
    batched_out: int
    batches: tuple[int, ...]  # end-to-end batched decode
    repeat: int


FULL = Shapes(32, 8, 128, (1024, 2048, 4096, 8192), (1, 8, 32, 128, 256), (1024, 8192, 32768), 2 * 2**30,
              dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=14336, vocab_size=128256), 128, 256, 64, (8, 32, 128), 10)
SMOKE = Shapes(4, 2, 64, (64,), (2,), (64,), 2**22,
               dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=256, vocab_size=4608), 16, 6, 4, (2,), 2)
MAX_KV_BYTES = 60 * GB  # a decode case whose KV is larger is skipped
MAX_REPEATED_KV_BYTES = 16 * GB  # SDPA over KV repeated to every q head: only below this
TOKENIZER_VOCAB = 4096  # smaller than the model's: prompts are token ids


# -- the JSON of figures --------------------------------------------------------------------
class Figures:
    """The JSON file at ``path``, rewritten whole (tmp file + rename) on every ``put``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        try:
            self.data: dict[str, Any] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def put(self, dotted: str, value: Any) -> None:
        *parents, last = dotted.split(".")
        node = self.data
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def error_text(e: BaseException, lines: int = 12) -> str:
    return "".join(traceback.format_exception(e)[-lines:])[-2000:]


class Budget:
    """Seconds since start, against ``limit``: later cases are skipped once it runs out."""

    def __init__(self, limit: float) -> None:
        self.start, self.limit = time.perf_counter(), limit

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.start)


# -- timing -----------------------------------------------------------------------------------
def median_ms(fn: Callable[[], Any], device, repeat: int, warmup: int = 3, flush: bool = True) -> float:
    """Median milliseconds of ``fn()``. On CUDA: events around each call, after a 256 MiB memset
    that evicts the L2 (60 MB on an H200), so every call reads its inputs from HBM; the memset
    also lets the host queue the call's launches before the GPU reaches them."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    scrub = torch.empty(2**28, dtype=torch.int8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in events:
        if flush:
            scrub.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth(device, nbytes: int, repeat: int) -> dict[str, float]:
    """A device-to-device copy: bytes read plus bytes written, over its time."""
    import torch

    src = torch.randint(0, 127, (nbytes,), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeat, flush=False)
    del src, dst
    return {"bytes_moved": 2 * nbytes, "ms": ms, "tb_s": 2 * nbytes / ms / 1e9}


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def pick_device(smoke: bool):
    """CUDA if there is one; in smoke mode the CPU otherwise (Triton kernels then interpreted)."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        raise SystemExit("no CUDA device: only --smoke runs on the CPU")
    # NOTE: triton.jit reads this when a kernel is defined, so before the backend is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


# -- env --------------------------------------------------------------------------------------
def cmd_env(fig: Figures, args: argparse.Namespace) -> None:
    import torch

    fig.put("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    fig.put("python", platform.python_version())
    fig.put("torch", torch.__version__)
    for name in ("triton", "transformers", "pydantic", "xgrammar", "outlines_core"):
        try:
            __import__(name)
            fig.put(name, importlib.metadata.version(name))
        except Exception as e:  # a missing package is a figure too
            fig.put(name, f"missing: {type(e).__name__}: {e}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        fig.put("gpu", p.name)
        fig.put("env", {"cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability(0)),
                        "sm_count": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1)})
    else:
        fig.put("gpu", "none (cpu)")
        fig.put("env", {"cpu_count": os.cpu_count()})


# -- kernels ----------------------------------------------------------------------------------
def load_triton_backend() -> tuple[Any, Any]:
    from modserve.attention_backends.triton_attention import TritonAttention

    try:
        from modserve.attention_backends.triton_attention import TritonOptions
    except ImportError:
        TritonOptions = None
    return TritonAttention, TritonOptions


def sdpa_variants(q, k, v, device) -> dict[str, Callable[[], Any]]:
    """The honest SDPA calls for q [B, H, Lq, D] over k, v [B, Hkv, L, D]: flash with native GQA,
    and flash over KV repeated to every q head (made before timing; only when it fits)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    causal = q.shape[2] > 1  # a decode's one query row sees the whole context
    group = q.shape[1] // k.shape[1]

    def flash(kk, vv, **kw):
        def call():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, **kw)
        return call

    out = {"flash_gqa": flash(k, v, enable_gqa=True)}
    if k.numel() * k.element_size() * 2 * group <= MAX_REPEATED_KV_BYTES:
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out["flash_repeat_kv"] = flash(kr, vr)
    return out


def attention_case(backend_cls, options_cls, s: Shapes, batch: int, q_len: int, seq_len: int,
                   device, dtype) -> dict[str, Any]:
    """One shape: B sequences of ``seq_len`` keys, the last ``q_len`` of them queries (causal)."""
    import torch

    from modserve.runner.batch import build_batch
    from modserve.core.contracts.attention_backend import AttentionSpec

    H, Hkv, D, bs = s.heads, s.kv_heads, s.head_dim, 16
    gen = torch.Generator(device).manual_seed(0)
    k = torch.randn(batch, Hkv, seq_len, D, device=device, dtype=dtype, generator=gen)  # [B, Hkv, L, D]
    v = torch.randn(batch, Hkv, seq_len, D, device=device, dtype=dtype, generator=gen)
    q = torch.randn(batch, H, q_len, D, device=device, dtype=dtype, generator=gen)  # [B, H, Lq, D]
    kv_bytes = 2 * k.numel() * k.element_size()
    io_bytes = 2 * q.numel() * q.element_size()  # q read, out written
    flops = 4 * batch * H * D * (q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2)  # causal pairs only
    res: dict[str, Any] = {"kv_bytes": kv_bytes, "flops": flops}
    sdpa_out = None
    for name, call in sdpa_variants(q, k, v, device).items():
        try:
            ms = median_ms(call, device, s.repeat)
            res[f"sdpa_{name}_ms"] = ms
            if "sdpa_ms" not in res or ms < res["sdpa_ms"]:
                res["sdpa_ms"], res["sdpa_call"], sdpa_out = ms, name, call()
        except Exception as e:
            res[f"sdpa_{name}_error"] = error_text(e, 2)
    free_memory()
    if backend_cls is None:
        res["triton_error"] = "missing: modserve.attention_backends.triton_attention"
        return res
    try:
        spec = AttentionSpec(num_layers=1, num_heads=H, num_kv_heads=Hkv, head_dim=D, scale=D**-0.5,
                             block_size=bs, dtype=dtype, device=device)
        backend = backend_cls(spec, options_cls() if options_cls else None)
        nb = -(-seq_len // bs)
        cache = torch.zeros(backend.kv_cache_shape(batch * nb), dtype=dtype, device=device)
        tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
        # Fill the cache through the backend's own write (whatever its layout), a few sequences at a
        # time so the [T, Hkv, D] copies stay small.
        per = max(1, int(2**29 // (seq_len * Hkv * D * k.element_size())))
        for a in range(0, batch, per):
            b = min(batch, a + per)
            _, fill = build_batch([[0] * seq_len] * (b - a), [0] * (b - a), tables[a:b], bs, device)
            backend.write(k[a:b].transpose(1, 2).reshape(-1, Hkv, D), v[a:b].transpose(1, 2).reshape(-1, Hkv, D),
                          cache, backend.prepare(fill))
        _, meta = build_batch([[0] * q_len] * batch, [seq_len - q_len] * batch, tables, bs, device)
        state = backend.prepare(meta)
        q_rows = q.transpose(1, 2).reshape(-1, H, D).contiguous()  # [T, H, D]
        ms = median_ms(lambda: backend.attend(q_rows, cache, state), device, s.repeat)
        out = backend.attend(q_rows, cache, state)  # [T, H, D]
        res["triton_ms"] = ms
        res["triton_splits"] = getattr(state, "num_splits", None)  # split-KV slices (decode)
        if sdpa_out is not None:
            want = sdpa_out.transpose(1, 2).reshape(-1, H, D).float()
            res["rel_err"] = float((out.float() - want).norm() / want.norm())
            res["ratio_triton_over_sdpa"] = ms / res["sdpa_ms"]
    except Exception as e:
        res["triton_error"] = error_text(e)
    res["hbm_tb_s"] = {n: (kv_bytes + io_bytes) / res[f"{n}_ms"] / 1e9 for n in ("triton", "sdpa") if f"{n}_ms" in res}
    res["tflop_s"] = {n: flops / res[f"{n}_ms"] / 1e9 for n in ("triton", "sdpa") if f"{n}_ms" in res}
    return res


def cmd_kernels(fig: Figures, args: argparse.Namespace) -> None:
    import torch

    s, budget = args.shapes, Budget(args.budget)
    device = pick_device(args.smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fig.put("kernels.dtype", str(dtype))
    bw = copy_bandwidth(device, s.copy_bytes, s.repeat)
    fig.put("kernels.copy_bandwidth", bw)
    print(f"copy bandwidth: {bw['tb_s']:.3g} TB/s", flush=True)
    try:
        backend_cls, options_cls = load_triton_backend()
    except Exception as e:  # being written: the SDPA side is still measured
        backend_cls = options_cls = None
        fig.put("kernels.triton_missing", error_text(e, 2))
    cases = [("prefill", 1, n, n) for n in s.prefill_lens]
    cases += [("decode", b, 1, c) for c in s.decode_contexts for b in s.decode_batches]
    for kind, batch, q_len, seq_len in cases:
        key = f"kernels.{kind}.b{batch}_L{seq_len}" if kind == "decode" else f"kernels.prefill.L{seq_len}"
        kv_bytes = 2 * batch * seq_len * s.kv_heads * s.head_dim * torch.finfo(dtype).bits // 8
        if kv_bytes > MAX_KV_BYTES:
            fig.put(key, {"skipped": f"KV of {kv_bytes / GB:.0f} GB"})
            continue
        if budget.left() < 0:
            fig.put(key, {"skipped": "time"})
            continue
        try:
            res = attention_case(backend_cls, options_cls, s, batch, q_len, seq_len, device, dtype)
            res["hbm_fraction"] = {n: t / bw["tb_s"] for n, t in res.get("hbm_tb_s", {}).items()}
        except Exception as e:
            res = {"error": error_text(e)}
        fig.put(key, res)
        print(f"{key}: {_brief(res)}", flush=True)
        free_memory()


# -- decode -----------------------------------------------------------------------------------
def fast_dir(need_bytes: int) -> str:
    """/dev/shm when it holds the checkpoint with room to spare, else /tmp."""
    for root in ("/dev/shm", tempfile.gettempdir()):
        try:
            if shutil.disk_usage(root).free > 1.3 * need_bytes + 2 * GB:
                return root
        except OSError:
            continue
    return tempfile.gettempdir()


def build_model(s: Shapes, device, dtype, fig: Figures):
    """A random Llama (std 0.02, seed 0) made on ``device`` in ``dtype``, saved with a tokenizer."""
    import torch
    import transformers as tf

    from modserve.testing.checkpoints import make_tokenizer

    t = time.perf_counter()
    cfg = tf.LlamaConfig(**s.model, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
                         pad_token_id=0, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = tf.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    model.generation_config = tf.GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    size = params * torch.finfo(dtype).bits // 8
    info: dict[str, Any] = {"params": params, "weight_bytes": size, "init_s": time.perf_counter() - t,
                            "rope": getattr(cfg, "rope_parameters", None),
                            # a decode step reads every weight but the embedding table (one row of it)
                            "weight_bytes_read_per_step": (params - embed) * torch.finfo(dtype).bits // 8,
                            "kv_bytes_per_token": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                            * (cfg.hidden_size // cfg.num_attention_heads) * torch.finfo(dtype).bits // 8}
    for root in dict.fromkeys((fast_dir(size), tempfile.gettempdir())):
        path = tempfile.mkdtemp(prefix="gpu-bench-llama-", dir=root)
        t = time.perf_counter()
        try:
            model.save_pretrained(path)
            make_tokenizer(TOKENIZER_VOCAB).save_pretrained(path)
            info.update(dir=path, save_s=time.perf_counter() - t)
            break
        except OSError as e:  # out of room: the next root
            shutil.rmtree(path, ignore_errors=True)
            info[f"save_error_{root}"] = error_text(e, 2)
    fig.put("decode.model", info)
    return info, model


class LogLines(logging.Handler):
    """The engine's log lines (compile, dtype, graphs) while it starts, for the JSON."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < 40:
            self.lines.append(record.getMessage()[:300])


def roofline(info: dict[str, Any], bw_tb_s: float, batch: int, prompt: int, out: int, tok_s: float) -> dict:
    """The bandwidth ceiling of a decode step: every weight read once, plus each sequence's KV
    at its mean context over the timed steps."""
    step_bytes = info["weight_bytes_read_per_step"] + batch * info["kv_bytes_per_token"] * (prompt + out / 2)
    ceiling = batch * bw_tb_s * 1e12 / step_bytes
    return {"bytes_per_step": step_bytes, "ceiling_tok_s": ceiling, "fraction": tok_s / ceiling}


def timed_generate(generate: Callable[[int], Any], n: int) -> float:
    """Seconds of ``n`` decode steps: a run to ``1 + n`` tokens less one to 1 (the prefill cancels;
    the shorter of two runs to 1, as it is the one whose noise weighs most)."""
    one = []
    for _ in range(2):
        t = time.perf_counter()
        generate(1)
        one.append(time.perf_counter() - t)
    t = time.perf_counter()
    generate(1 + n)
    return time.perf_counter() - t - min(one)


def decode_span(outs: list[Any]) -> dict[str, float]:
    """The engine's own token times: the steps after every request had its first token (pure
    decode steps, all sequences running), their seconds and the tokens they made."""
    start = max(o.metrics.token_times[0] for o in outs)
    later = [t for o in outs for t in o.metrics.token_times if t > start]
    return {"decode_s": max(later) - start, "tokens": len(later), "steps": len(set(later))}


def graph_counters(step_forward: Any) -> dict[str, Any]:
    """What runs a step: DecodeGraphs (sizes captured, replays per size, eager steps) or the
    runner's own forward (no graphs)."""
    out: dict[str, Any] = {"type": type(step_forward).__name__}
    if hasattr(step_forward, "replays"):
        out.update(sizes=list(getattr(step_forward, "sizes", [])), replays={str(k): v for k, v in
                   sorted(step_forward.replays.items())}, eager_steps=getattr(step_forward, "eager_steps", None))
    return out


def modserve_decode(path: str, s: Shapes, device, dtype, info: dict, bw: float, **engine: Any) -> dict[str, Any]:
    import torch

    from modserve import LLM, SamplingParams

    logs = LogLines()
    log = logging.getLogger("modserve")
    log.addHandler(logs)
    level = log.level
    log.setLevel(logging.INFO)  # NOTE: setLevel, not .level: it clears the loggers' cached levels
    t = time.perf_counter()
    try:
        llm = LLM(path, device=device.type, dtype=str(dtype).removeprefix("torch."), progress=False,
                  max_model_len=s.prompt_len + s.single_out + 64, max_num_seqs=max(s.batches),
                  **({"kv_cache_memory_gb": 8.0} if device.type == "cuda" else {"num_kv_blocks": 128}), **engine)
    finally:
        log.removeHandler(logs)
        log.setLevel(level)
    res: dict[str, Any] = {"load_s": time.perf_counter() - t, "engine_log": logs.lines,
                           "compiled": getattr(llm.engine.runner, "compiled", None)}
    gen = torch.Generator().manual_seed(1)

    def prompts(n: int) -> list[list[int]]:  # distinct, so no prefix is shared
        return torch.randint(3, TOKENIZER_VOCAB, (n, s.prompt_len), generator=gen).tolist()

    try:
        for batch, out in [(1, s.single_out), *((b, s.batched_out) for b in s.batches)]:
            p = prompts(batch)

            def run(n: int) -> list[Any]:
                outs = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == n for o in outs)
                return outs

            run(2)  # warm: graphs of this size, kernels, allocator
            span = decode_span(run(1 + out))
            tok_s = span["tokens"] / span["decode_s"]
            res[f"b{batch}"] = {"out_tokens": out, **span, "tok_s": tok_s,
                                "ms_per_step": span["decode_s"] / span["steps"] * 1e3,
                                **roofline(info, bw, batch, s.prompt_len, out, tok_s)}
        res["graphs"] = graph_counters(llm.engine.runner.step_forward)
    finally:
        llm.shutdown()
        del llm
        free_memory()
    return res


def hf_decode(model, s: Shapes, device, info: dict, bw: float, compiled: bool) -> dict[str, Any]:
    """transformers' ``generate`` with a static cache, single-stream; the forward compiled with
    mode reduce-overhead (CUDA graphs) or eager."""
    import torch

    ids = torch.randint(3, TOKENIZER_VOCAB, (1, s.prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run(n: int) -> None:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                 cache_implementation="static", disable_compile=True)  # ours, or eager
        assert out.shape[1] == s.prompt_len + n

    try:
        t = time.perf_counter()
        # Compiled, the longest run first: later, shorter ones reuse its static cache's shapes.
        run(1 + s.single_out if compiled else 8)
        warm = time.perf_counter() - t
        sec = timed_generate(run, s.single_out)
    finally:
        model.__dict__.pop("forward", None)  # back to the eager forward
    tok_s = s.single_out / sec
    return {"warmup_s": warm, "out_tokens": s.single_out, "decode_s": sec, "tok_s": tok_s,
            "ms_per_step": sec / s.single_out * 1e3, **roofline(info, bw, 1, s.prompt_len, s.single_out, tok_s)}


def cmd_decode(fig: Figures, args: argparse.Namespace) -> None:
    import torch

    s, budget = args.shapes, Budget(args.budget)
    device = pick_device(args.smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bw = copy_bandwidth(device, s.copy_bytes, s.repeat)["tb_s"]
    fig.put("decode.bandwidth_tb_s", bw)
    info, model = build_model(s, device, dtype, fig)
    path = info.get("dir")
    # (name, seconds it needs at least, what it runs), by value: the engine's fast path, then the
    # baseline it is held against (whose compile may take minutes), then the eager variants.
    runs: list[tuple[str, float, Callable[[], dict]]] = [
        ("triton_graphs", 0, lambda: modserve_decode(path, s, device, dtype, info, bw, attention_backend="triton")),
        ("hf_static_compiled", 60, lambda: hf_decode(model, s, device, info, bw, compiled=True)),
        ("hf_static_eager", 25, lambda: hf_decode(model, s, device, info, bw, compiled=False)),
        ("triton_eager", 30, lambda: modserve_decode(path, s, device, dtype, info, bw, attention_backend="triton",
                                                     cuda_graph_sizes=[])),
        ("paged", 30, lambda: modserve_decode(path, s, device, dtype, info, bw, attention_backend="paged")),
    ]
    try:
        for name, needs, run in runs:
            if path is None and not name.startswith("hf"):
                fig.put(f"decode.{name}", {"skipped": "no checkpoint saved"})
                continue
            if name == "hf_static_compiled" and (args.smoke or device.type != "cuda"):
                fig.put(f"decode.{name}", {"skipped": "smoke: no torch.compile"})
                continue
            if budget.left() < needs:
                fig.put(f"decode.{name}", {"skipped": "time"})
                continue
            # NOTE: the alarm interrupts a compile that would outlast the budget; the eager runs follow.
            alarm = name == "hf_static_compiled" and hasattr(signal, "SIGALRM")
            if alarm:
                signal.signal(signal.SIGALRM, _out_of_time)
                signal.alarm(max(1, int(budget.left() - 35)))  # leave the eager baseline its time
            t = time.perf_counter()
            try:
                res = run()
            except Exception as e:  # the alarm's TimeoutError too
                res = {"error": error_text(e)}
            finally:
                if alarm:
                    signal.alarm(0)
            res["wall_s"] = time.perf_counter() - t
            fig.put(f"decode.{name}", res)
            print(f"decode {name}: {_brief(res)}", flush=True)
            free_memory()
    finally:
        del model
        if path:
            shutil.rmtree(path, ignore_errors=True)


def _brief(res: dict[str, Any]) -> str:
    """A result's numbers on one line, for the log (errors by their last line)."""
    if "error" in res:
        return "error: " + res["error"].strip().splitlines()[-1]
    flat = {k: v for k, v in res.items() if isinstance(v, (int, float, str)) and k != "engine_log"}
    flat.update({k: v.get("tok_s") for k, v in res.items() if isinstance(v, dict) and "tok_s" in v})
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in flat.items())[:400]


def _out_of_time(signum: int, frame: Any) -> None:
    raise TimeoutError("the decode budget ran out during this run")


# -- record and summary (stdlib only: they run when torch does not) ---------------------------
def cmd_record(fig: Figures, args: argparse.Namespace) -> None:
    """After a phase of gpu_check.sh: its seconds, its failure (rc and the log's tail) and, for
    the CUDA tests, pytest's counts read from the log (also from a log cut off by a timeout)."""
    text = Path(args.log).read_text(errors="replace") if Path(args.log).is_file() else ""
    fig.put(f"phase_seconds.{args.phase}", args.seconds)
    if args.rc != 0:
        fig.put(f"failed.{args.phase}", {"rc": args.rc, "timed_out": args.rc in (124, 137),
                                         "tail": "\n".join(text.splitlines()[-40:])[-4000:]})
    if args.phase == "cuda_tests":
        fig.put("cuda_tests", pytest_counts(text))


def pytest_counts(text: str) -> dict[str, Any]:
    """Counts from ``pytest -v``'s per-test lines, and the final summary line when there is one."""
    results = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.M)
    counts: dict[str, Any] = {}
    for _, outcome in results:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    counts["not_passed"] = [f"{t} {o}" for t, o in results if o not in ("PASSED", "SKIPPED")][:30]
    summary = re.findall(r"^=+ (.*(?:passed|failed|error|skipped|deselected).*) =+$", text, re.M)
    counts["summary"] = summary[-1] if summary else "none (cut off?)"
    return counts


def cmd_summary(fig: Figures, args: argparse.Namespace) -> None:
    """The figures as a short table: what a reader of the log's end needs first."""
    d = fig.data

    def num(x: Any, fmt: str = "{:.3g}") -> str:
        return fmt.format(x) if isinstance(x, (int, float)) else "-"

    print(f"\n## gpu_check {d.get('date', '?')}: {d.get('gpu', '?')}, torch {d.get('torch', '?')}, "
          f"triton {d.get('triton', '?')}, transformers {d.get('transformers', '?')}")
    t = d.get("cuda_tests", {})
    counts = ", ".join(f"{t[k]} {k}" for k in ("passed", "failed", "error", "skipped") if k in t)
    print(f"cuda tests: {t.get('summary', '-')} (lines read: {counts or 'none'})")
    for line in t.get("not_passed", []):
        print(f"  {line}")
    k = d.get("kernels", {})
    print(f"copy bandwidth: {num(k.get('copy_bandwidth', {}).get('tb_s'))} TB/s")
    print("| kernel case | triton ms | sdpa ms (call) | triton/sdpa | TFLOP/s t/s | HBM frac t/s | rel err |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("prefill", "decode"):
        for case, r in k.get(kind, {}).items():
            if "skipped" in r or "error" in r:
                print(f"| {kind} {case} | {r.get('skipped') or 'error'} ||||||")
                continue
            tf, hf = r.get("tflop_s", {}), r.get("hbm_fraction", {})
            print(f"| {kind} {case} | {num(r.get('triton_ms'))} | {num(r.get('sdpa_ms'))} ({r.get('sdpa_call', '-')}) "
                  f"| {num(r.get('ratio_triton_over_sdpa'))} | {num(tf.get('triton'))}/{num(tf.get('sdpa'))} "
                  f"| {num(hf.get('triton'))}/{num(hf.get('sdpa'))} | {num(r.get('rel_err'))} |")
    dec = d.get("decode", {})
    print(f"decode (bandwidth {num(dec.get('bandwidth_tb_s'))} TB/s): tok/s (fraction of the roofline)")
    for name in ("triton_graphs", "triton_eager", "hf_static_compiled", "hf_static_eager", "paged"):
        r = dec.get(name)
        if r is None:
            continue
        if "tok_s" in r:  # transformers: single-stream only
            r = {"b1": r}
        cells = [f"b{b}: {num(x['tok_s'], '{:.0f}')} ({num(x['fraction'], '{:.2f}')} of "
                 f"{num(x['ceiling_tok_s'], '{:.0f}')})" for b in (1, 2, 8, 32, 128) if (x := r.get(f"b{b}"))]
        graphs = r.get("graphs", {})
        replays = "" if not graphs else f"; graphs {graphs.get('sizes')}, {sum(graphs['replays'].values())} " \
            "replays" if "replays" in graphs else "; no graphs"
        print(f"  {name}: {'; '.join(cells) or r.get('skipped') or r.get('error', '?')[-200:]}{replays}")
    for phase, f in d.get("failed", {}).items():
        print(f"FAILED {phase}: rc {f.get('rc')}{' (timeout)' if f.get('timed_out') else ''}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the figures JSON (merged into)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU")
    ap.add_argument("--budget", type=float, default=None, help="seconds before later cases are skipped")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("env", "kernels", "decode", "summary"):
        sub.add_parser(name)
    rec = sub.add_parser("record")
    rec.add_argument("phase")
    rec.add_argument("rc", type=int)
    rec.add_argument("log")
    rec.add_argument("--seconds", type=float, default=None)
    args = ap.parse_args(argv)
    args.shapes = SMOKE if args.smoke else FULL
    if args.budget is None:
        args.budget = {"kernels": 75.0, "decode": 270.0}.get(args.cmd, 1e9)
    commands = {"env": cmd_env, "kernels": cmd_kernels, "decode": cmd_decode, "record": cmd_record,
                "summary": cmd_summary}
    commands[args.cmd](Figures(args.out), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
