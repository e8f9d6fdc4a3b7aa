"""``modserve bench {throughput,latency,serve,collectives}``, ``modserve compare`` and ``modserve plan``.

Heavy imports (torch, transformers, httpx) happen inside the commands.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from modserve.bench.collectives import parse_bytes
from modserve.bench.metrics import Spread, parse_metric_percentiles, parse_percentile_metrics, ratio_spread
from modserve.bench.pinning import add_pinning_flags, pin
from modserve.bench.plan import INTERCONNECTS
from modserve.bench.workloads import add_workload_flags

HARDWARE_CHOICES = ("h100", "h200", "b200", "a100-80g", "cpu")


def add_parsers(sub: Any) -> None:
    from modserve.cli import add_config_flags

    bench = sub.add_parser("bench", help="benchmark throughput, latency, or a running server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    p = kinds.add_parser("throughput", help="offline: a workload through LLM.generate")
    add_config_flags(p)
    add_workload_flags(p, num_prompts=64)
    add_pinning_flags(p)
    p.add_argument("--baseline", nargs="+", choices=["hf", "vllm"], default=[],
                   help="also run these, interleaved: transformers generate (hf), an installed vLLM (vllm)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf baseline")
    p.add_argument("--n", type=int, default=1,
                   help="vLLM's: sequences per prompt, sampled at temperature 1 as vLLM's (default 1: greedy); "
                        "output tok/s counts them all")
    p.add_argument("--hardware", choices=HARDWARE_CHOICES, default=None,
                   help="for the compute ceiling (default: cpu, measured, when the device is the CPU)")
    _add_vllm_flags(p)
    add_output_flags(p, "every run's figures")
    p.set_defaults(func=cmd_throughput)

    p = kinds.add_parser("latency", help="offline: single-stream TTFT and time per output token")
    add_config_flags(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1,
                   help="vLLM's: requests generated at once per run, the latency being the batch's "
                        "(default 1, a single stream; vLLM's is 8)")
    p.add_argument("--hardware", choices=HARDWARE_CHOICES, default=None,
                   help="for the decode ceiling (default: cpu, measured, when the device is the CPU)")
    p.add_argument("--baseline", choices=["vllm", "llama.cpp"],
                   help="also run an installed vLLM or llama.cpp's llama-bench, interleaved")
    _add_vllm_flags(p)
    _add_llamacpp_flags(p)
    add_pinning_flags(p)
    add_output_flags(p, "every run's figures")
    p.set_defaults(func=cmd_latency)

    p = kinds.add_parser("serve", help="load-test an OpenAI-compatible server")
    p.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="the server's host, without --base-url")
    p.add_argument("--port", type=int, default=8000, help="the server's port, without --base-url")
    p.add_argument("--backend", choices=["vllm", "openai", "openai-chat"], default="openai",
                   help="vLLM's spelling of the endpoint: openai-chat means /v1/chat/completions")
    p.add_argument("--endpoint", default=None,
                   help="/v1/completions or /v1/chat/completions (default: the --backend's)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="always on: every request generates exactly its output length (vLLM's flag)")
    p.add_argument("--model", help="model name to request (default: the first of /v1/models); a checkpoint "
                                   "directory is the tokenizer too, unless --tokenizer says otherwise")
    p.add_argument("--served-model-name", help="vLLM's: the name to request, when --model is the checkpoint")
    p.add_argument("--tokenizer", help="tokenizer directory: the vocabulary of random workloads, "
                                       "reply lengths of ShareGPT files")
    add_workload_flags(p, num_prompts=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs a request must meet to count towards goodput: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--request-timeout", type=float, default=600.0)
    g = p.add_argument_group("vLLM's bench serve flags")
    g.add_argument("--header", action="extend", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra HTTP headers on every request; $OPENAI_API_KEY, when set, goes as "
                        "'Authorization: Bearer KEY' (a --header Authorization=... replaces it)")
    g.add_argument("--percentile-metrics", type=parse_percentile_metrics, default="ttft,tpot,itl",
                   help="comma list of ttft, tpot, itl, e2el: the metrics whose percentiles are reported "
                        "(default: ttft,tpot,itl, as vLLM's)")
    g.add_argument("--metric-percentiles", type=parse_metric_percentiles, default="99",
                   help="comma list of percentiles reported for them, e.g. 50,90,99 (default: 99)")
    add_pinning_flags(p, warmups="warm-up requests sent (one at a time) before each timed run",
                      repeats="timed runs (default: 1, as vLLM's; with --baseline-url 3 interleaved pairs); "
                              "figures are median [min-max]")
    p.set_defaults(repeats=None)
    add_output_flags(p, "the full result (every request's timings)")
    p.add_argument("--baseline-url", help="a second server (vLLM, say) run interleaved with the first, "
                   "the same workload and arrivals: both columns, their ratio, and latency CDFs in a PNG")
    p.add_argument("--names", nargs=2, default=["server", "baseline"], metavar=("FIRST", "BASELINE"),
                   help="column names of --base-url and --baseline-url")
    p.add_argument("--plot", default="build/serve.png", help="with --baseline-url: the PNG's path")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("compare", help="A/B two engine configs: agreement, logits, speed")
    p.add_argument("config_a")
    p.add_argument("config_b")
    add_config_flags(p, config_file=False, title="engine config (applied to both configs; --model: the model of both)")
    add_workload_flags(p, num_prompts=16)
    add_pinning_flags(p)
    p.add_argument("--probe-prompts", type=int, default=4, help="prompts whose logits are compared")
    p.add_argument("--probe-tokens", type=int, default=8, help="decode steps per probe prompt")
    p.add_argument("--min-agreement", type=float, default=0.9,
                   help="fail (exit 1) when fewer requests than this fraction agree exactly")
    p.add_argument("--max-logit-diff", type=float, default=None,
                   help="fail (exit 1) when the max logit difference exceeds this")
    g = p.add_argument_group("quality gates (run through A and B after the speed runs; docs/evaluation.md)")
    g.add_argument("--eval-task", metavar="FILE", help="a JSONL loglikelihood task (modserve eval task's format)")
    g.add_argument("--eval-text", metavar="FILE", help="a text whose rolling-window perplexity is measured")
    g.add_argument("--eval-max-length", type=int, default=None,
                   help="perplexity window, tokens (default: 1024, at most max_model_len - 1 of both)")
    g.add_argument("--eval-stride", type=int, default=None, help="perplexity stride (default: max length / 2)")
    g.add_argument("--min-task-accuracy-delta", type=float, default=None, metavar="X",
                   help="fail (exit 1) when acc(B) - acc(A) < X, e.g. -0.02; needs --eval-task")
    g.add_argument("--max-perplexity-ratio", type=float, default=None, metavar="R",
                   help="fail (exit 1) when ppl(B) / ppl(A) > R, e.g. 1.01; needs --eval-text")
    p.add_argument("--out-dir", default="build/compare", help="where compare.md and compare.png go")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("plan", help="capacity planning: memory, KV budget, decode ceiling")
    p.add_argument("--model", required=True, help="checkpoint directory or its config.json")
    p.add_argument("--hardware", choices=HARDWARE_CHOICES, default="h100")
    p.add_argument("--dtype", help="weights: float32, bfloat16, float16, fp8, int8, int4 (default: the checkpoint's)")
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype",
                   help="KV cache values: fp8 (fp8_e4m3), bfloat16, ... (default: the weights', at least bfloat16)")
    p.add_argument("--quantization", help="quantizer (int8, fp8, awq, gptq): weights as it stores them, "
                                          "--dtype for the rest (needs a checkpoint directory)")
    p.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tp", type=int, default=1,
                   help="tensor-parallel devices")
    p.add_argument("--pipeline-parallel-size", "-pp", "--pp", dest="pp", type=int, default=1,
                   help="pipeline stages: layers per stage, the activations sent between them, the bubble")
    p.add_argument("--context-len", type=int, default=0, help="tokens of KV each decode step reads")
    p.add_argument("--gpu-memory-utilization", "--memory-fraction", dest="memory_fraction", type=float,
                   default=0.9, help="of device memory for weights + KV")
    g = p.add_argument_group("parallelism's communication (with --tp or --pp above 1)")
    g.add_argument("--batch-size", type=int, default=1, help="sequences per decode step")
    g.add_argument("--allreduce-json", metavar="PATH",
                   help="all-reduce times measured by 'modserve bench collectives --json PATH'")
    g.add_argument("--interconnect", choices=list(INTERCONNECTS),
                   help="without --allreduce-json: a preset link (default: the --hardware's; cpu: loopback-gloo)")
    g.add_argument("--micro-batches", type=int, default=None, help="in flight through the pipeline (default: --pp)")
    g = p.add_argument_group("disaggregated prefill and decode (docs/disaggregation.md): a prefill pool and a "
                             "decode pool of instances of these devices; --batch-size is the decode batch, "
                             "--interconnect the link the KV crosses (ib-ndr400 between nodes)")
    g.add_argument("--disaggregate", action="store_true", help="size the two pools for the workload below")
    g.add_argument("--input-len", type=int, default=None, help="prompt tokens per request (needed)")
    g.add_argument("--output-len", type=int, default=None, help="generated tokens per request (needed)")
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests/s to size the pools for (default: only their ratio)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = kinds.add_parser("collectives", help="all-reduce / all-gather latency and bus bandwidth of real "
                                             "process groups (gloo on CPU, NCCL on CUDA)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (processes) to spawn")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo; cuda: NCCL, one GPU per rank")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the tensors' (default: float32 on CPU, bfloat16 on CUDA); sizes are bytes either way")
    p.add_argument("--min-bytes", type=parse_bytes, default=4 * 2**10,
                   help="smallest all-reduce, e.g. 4K: a decode step's hidden state for a few sequences")
    p.add_argument("--max-bytes", type=parse_bytes, default=None,
                   help="largest all-reduce, e.g. 64M (default: 64 MiB on CUDA, 16 MiB on CPU)")
    p.add_argument("--step-factor", "-f", dest="factor", type=int, default=2, help="size multiplier between steps")
    p.add_argument("--gather-bytes", type=parse_bytes, nargs="+", default=None,
                   help="all-gather sizes, gathered (default: 64K, 1M, 4M inside the sweep)")
    add_pinning_flags(p)
    p.set_defaults(repeats=20, warmups=5)
    p.add_argument("--json", metavar="PATH", help="write the results and the machine's details here")
    p.add_argument("--plot", metavar="PATH", help="a PNG of latency and busbw vs size")
    p.set_defaults(func=cmd_collectives)


def add_output_flags(p: argparse.ArgumentParser, what: str) -> None:
    """``--output-json PATH`` (``--result-json`` is an alias), and vLLM's ``--save-result``
    with ``--result-dir`` and ``--result-filename``."""
    g = p.add_argument_group("result file")
    g.add_argument("--output-json", "--result-json", dest="output_json", metavar="PATH", help=f"write {what} here")
    g.add_argument("--save-result", action="store_true",
                   help="vLLM's: write it to --result-dir/--result-filename (default: a timestamped name)")
    g.add_argument("--result-dir", default=None, help="vLLM's: the folder of --save-result (default: .)")
    g.add_argument("--result-filename", default=None, help="vLLM's: the file name (implies --save-result)")


def output_path(args: argparse.Namespace, kind: str) -> str | None:
    """Where the result goes: ``--output-json``, else vLLM's ``--result-dir``/``--result-filename``."""
    if args.output_json:
        return args.output_json
    if not (args.save_result or args.result_filename):
        return None
    name = args.result_filename or f"modserve-bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return str(Path(args.result_dir or ".") / name)


def _add_llamacpp_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the llama.cpp baseline (modserve/bench/llamacpp_baseline.py)")
    g.add_argument("--llama-cpp-dir", metavar="DIR",
                   help="a llama.cpp tree: its convert_hf_to_gguf.py and a built build/bin/llama-bench")
    g.add_argument("--llama-bench", metavar="PATH", help="the llama-bench binary (default: in --llama-cpp-dir)")
    g.add_argument("--gguf", metavar="PATH", help="a GGUF of the same checkpoint (default: convert it once, "
                                                  "with --llama-cpp-dir's converter, into the user cache)")
    g.add_argument("--gguf-outtype", choices=["f32", "f16", "bf16", "q8_0"],
                   help="the GGUF's weight type when converting (default: the checkpoint's dtype)")


def _checkpoint_outtype(llm: Any) -> str:
    """The GGUF type of the weights a decode step reads: the checkpoint's (a bf16 checkpoint's
    weights stay bf16 on CPU, computed in float32), else the engine's dtype."""
    types = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
    config = json.loads((Path(llm.config.model) / "config.json").read_text())
    stored = str(config.get("dtype") or config.get("torch_dtype") or "")
    return types.get(stored) or types.get(str(llm.dtype).removeprefix("torch."), "f32")


def _llamacpp_runner(args: argparse.Namespace, llm: Any) -> Any:
    import platformdirs
    import torch

    from modserve.bench.llamacpp_baseline import LlamaCppRunner, convert, find_tools, gguf_path

    bench, converter = find_tools(args.llama_cpp_dir, args.llama_bench)
    if args.gguf:
        gguf = Path(args.gguf)
    else:
        outtype = args.gguf_outtype or _checkpoint_outtype(llm)
        cache = Path(platformdirs.user_cache_dir("modserve")) / "gguf"
        gguf = convert(llm.config.model, converter, outtype, gguf_path(llm.config.model, outtype, cache))
    return LlamaCppRunner(bench, gguf, torch.get_num_threads())


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline-python", metavar="PATH",
                   help="the Python that runs the vllm baseline (default: this one); it must have vLLM")
    p.add_argument("--vllm-dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="the vllm baseline's dtype (default: auto, vLLM's own default: a bf16 checkpoint in bf16)")


# -- offline ---------------------------------------------------------------------------
def _engine(args: argparse.Namespace):
    from modserve import LLM
    from modserve.cli import config_from_args

    return LLM(config=config_from_args(args), progress=False)


def _header(llm: Any, pinning: str) -> list[str]:
    import torch

    cfg = llm.config
    dtype, gemm = str(llm.dtype).removeprefix("torch."), _gemm_dtype(llm)
    dtypes = dtype if gemm == dtype else f"{dtype} activations, {gemm} linears"
    if cfg.quantization:  # its choices (an int8 prefill's activations) are in the log, at INFO
        q = cfg.quantization
        dtypes += f", quantization {q.name}" + (f" {json.dumps(q.options)}" if q.options else "")
    return [f"model: {cfg.model} ({dtypes}, device {cfg.device})",
            f"engine: attention {cfg.attention_backend.name}, kv_allocator {cfg.kv_allocator.name}, "
            f"scheduler {cfg.scheduler.name}, max_num_seqs {cfg.max_num_seqs}",
            f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {pinning}",
            f"device: {llm.describe_device()}"]


def _workload_line(args: argparse.Namespace, requests: Sequence[Any]) -> str:
    prompt = sum(r.prompt_len for r in requests)
    output = sum(r.output_len for r in requests)
    return (f"workload: {args.workload}, {len(requests)} requests, {prompt:,} prompt + {output:,} output "
            f"tokens (greedy, EOS ignored)")


def _vllm_runner(args: argparse.Namespace, llm: Any, max_model_len: int, log_stats: bool = False) -> Any:
    from modserve.bench.vllm_baseline import VLLMRunner

    dtype = args.vllm_dtype
    # the baseline caches prefixes if modserve's KV allocator does
    return VLLMRunner(args.baseline_python, llm.config.model, dtype, max_model_len, llm.prefix_caching, log_stats)


def _ratio_line(figures: dict[str, list[dict[str, float]]], baseline: str, key: str) -> str:
    """modserve over a baseline, per interleaved pair of repeats, then median [min-max]."""
    ratio = ratio_spread([f[key] for f in figures["modserve"]], [f[key] for f in figures[baseline]])
    return f"modserve / {baseline}: {key} {ratio.format(2)}x"


def _agreement_line(runs: dict[str, Any], baseline: str, label: str) -> str:
    from modserve.bench.offline import agreement

    rate, diverged = agreement(runs["modserve"][0].token_ids, runs[baseline][0].token_ids)
    where = f"; the others first differ at tokens {sorted(diverged)[:10]}" if diverged else ""
    return f"greedy agreement with {label}: {rate:.1%} of requests identical{where}"


def _write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2))
        print(f"wrote {path}")


def cmd_throughput(args: argparse.Namespace) -> int:
    from modserve.bench.bubble import StageClock, bubble_line, idle_fractions
    from modserve.bench.offline import EngineRunner, interleave
    from modserve.bench.report import spread_table
    from modserve.bench.vllm_baseline import VLLMUnavailable
    from modserve.bench.workloads import load_workload, tokenize

    if args.n < 1:
        raise ValueError(f"--n must be at least 1, got {args.n}")
    if args.n > 1 and args.baseline:
        raise ValueError(f"--n {args.n} runs modserve only: the {' and '.join(args.baseline)} baseline here "
                         f"generates one greedy sequence per prompt; drop --baseline, or --n")
    pinning = pin(args)
    llm = _engine(args)
    tok = llm.get_tokenizer()
    requests = tokenize(load_workload(args, tok), tok)
    runners: list[Any] = [EngineRunner(llm, n=args.n)]
    try:
        if "vllm" in args.baseline:  # first: a missing vLLM should fail before the hf model loads
            runners.append(_vllm_runner(args, llm, max(r.prompt_len + r.output_len for r in requests)))
        if "hf" in args.baseline:
            from modserve.bench.hf_baseline import HFRunner

            runners.append(HFRunner(llm.config.model, llm.dtype, args.hf_batch_size))
        clock = StageClock.read(llm)
        runs = interleave(runners, requests, args.repeats, args.warmups)
        idle = idle_fractions(clock, StageClock.read(llm), llm.config.tensor_parallel_size) if clock else None
    except VLLMUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for runner in runners:
            if hasattr(runner, "close"):
                runner.close()
    figures = {name: [r.figures() for r in rs] for name, rs in runs.items()}
    print("\n".join(_header(llm, pinning) + [r.describe() for r in runners if hasattr(r, "describe")]
                    + [_workload_line(args, requests)]))
    if args.n > 1:
        print(f"--n {args.n}: {args.n} sequences per prompt, sampled at temperature 1 (not greedy)")
    print(f"median [min-max] over {args.repeats} repeats" + (", interleaved" if len(runners) > 1 else ""))
    print(spread_table(figures))
    if idle is not None:  # NOTE: over every runner's runs: the baselines' time counts as idle
        print(bubble_line(idle, llm.config.pipeline_in_flight))
        figures["pipeline_idle_fraction"] = idle  # type: ignore[assignment]
    for runner in runners[1:]:
        print(_ratio_line(figures, runner.name, "output tok/s"))
        label = f"hf (batch {args.hf_batch_size})" if runner.name == "hf" else runner.name
        print(_agreement_line(runs, runner.name, label))
    if load := llm.expert_load():
        print("\n".join(expert_load_lines(load)))
        figures["expert_load"] = expert_load_figures(load)  # type: ignore[assignment]
    if ceiling := _compute_ceiling(args, llm, [(r.prompt_len, r.output_len * args.n) for r in requests],
                                   Spread.of([r["wall s"] for r in figures["modserve"]]).median):
        hw_name, fraction = ceiling
        print(fraction.line(hw_name, "modserve (median run)"))
        figures["compute_ceiling_fraction"] = fraction.fraction  # type: ignore[assignment]
    _write_json(output_path(args, "throughput"), figures)
    return 0


def _gemm_dtype(llm: Any) -> str:
    """The dtype the float linears multiply in, whose GEMM rate is the compute ceiling: the
    compute dtype, or bfloat16 where the platform kept bf16 weights (the CPU's bf16_gemm route)."""
    import torch

    from modserve.api import float_layers

    layers = float_layers(llm.model_module)
    # a tied head may stay float32; a layer with a decode copy (the CPU's few-rows route) multiplies
    # batches in float32, whatever its weight's dtype
    bf16_weights = any(m.weight.dtype == torch.bfloat16 and not hasattr(m, "decode_weight") for m in layers)
    return "bfloat16" if bf16_weights else str(llm.dtype).removeprefix("torch.")


def _compute_ceiling(args: argparse.Namespace, llm: Any, lengths: list[tuple[int, int]],
                     seconds: float) -> tuple[str, Any] | None:
    """(hardware, :class:`~modserve.bench.roofline.ComputeFraction`) of a run of these
    requests in ``seconds``, on ``--hardware`` (default: this CPU, measured)."""
    from modserve.bench.plan import ModelShape, hardware
    from modserve.bench.roofline import compute_fraction

    hw_name = args.hardware or ("cpu" if llm.config.device == "cpu" else None)
    if not hw_name:
        return None
    dtype = _gemm_dtype(llm)
    return hw_name, compute_fraction(ModelShape.load(llm.config.model), hardware(hw_name, dtype), dtype, lengths,
                                     seconds)


def expert_load_figures(load: dict[int, list[int]]) -> dict[str, Any]:
    """Per MoE layer: tokens routed to each expert (over every run and warm-up), the imbalance
    (the hottest expert over the mean) and the hottest expert."""
    from modserve.server.metrics import imbalance

    return {str(layer): {"tokens": counts, "imbalance": round(imbalance(counts), 3),
                         "hottest": max(range(len(counts)), key=counts.__getitem__)}
            for layer, counts in sorted(load.items())}


def expert_load_lines(load: dict[int, list[int]]) -> list[str]:
    lines = ["expert load (tokens routed per expert over every run; imbalance = hottest / mean):"]
    for layer, f in expert_load_figures(load).items():
        total = sum(f["tokens"]) or 1
        lines.append(f"  layer {layer}: imbalance {f['imbalance']:.2f}, hottest expert {f['hottest']} "
                     f"({100 * f['tokens'][f['hottest']] / total:.1f}% of routed tokens), "
                     f"idle experts {sum(1 for n in f['tokens'] if n == 0)} of {len(f['tokens'])}")
    return lines


def cmd_latency(args: argparse.Namespace) -> int:
    from modserve.bench.bubble import StageClock, bubble_line, idle_fractions
    from modserve.bench.offline import single_stream, vllm_latency_keys
    from modserve.bench.plan import ModelShape, hardware, plan
    from modserve.bench.report import spread_table
    from modserve.bench.llamacpp_baseline import LlamaCppUnavailable
    from modserve.bench.roofline import compute_fraction
    from modserve.bench.vllm_baseline import VLLMUnavailable

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.batch_size > 1 and args.baseline:
        raise ValueError(f"--batch-size {args.batch_size} times modserve only: the {args.baseline} baseline "
                         f"here times one stream; drop --baseline, or --batch-size")
    pinning = pin(args)
    llm = _engine(args)
    baselines: list[Any] = []
    try:
        if args.baseline == "vllm":
            baselines.append(_vllm_runner(args, llm, args.input_len + args.output_len, log_stats=True))
        elif args.baseline == "llama.cpp":
            baselines.append(_llamacpp_runner(args, llm))
        clock = StageClock.read(llm)
        all_runs = single_stream(llm, args.input_len, args.output_len, args.repeats, args.warmups,
                                 baselines=baselines, batch_size=args.batch_size)
        idle = idle_fractions(clock, StageClock.read(llm), llm.config.tensor_parallel_size) if clock else None
    except (VLLMUnavailable, LlamaCppUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for b in baselines:
            b.close()
    figures = {name: [r.figures() for r in rs] for name, rs in all_runs.items()}
    runs = figures["modserve"]
    print("\n".join(_header(llm, pinning) + [b.describe() for b in baselines]))
    stream = "single stream" if args.batch_size == 1 else (
        f"a batch of {args.batch_size} (TTFT and E2E: the batch's last; decode tok/s: the batch's)")
    print(f"{stream}: {args.input_len} prompt tokens, {args.output_len} output tokens; "
          f"median [min-max] over {args.repeats} runs" + (", interleaved" if baselines else ""))
    print(spread_table(figures, digits=2))
    for b in baselines:
        print(_ratio_line(figures, b.name, "decode tok/s"))
        how = {"metrics": "its RequestOutput.metrics timestamps",
               "llama-bench": f"llama-bench's pp{args.input_len} (TTFT = prompt / its tok/s) and tg{args.output_len} "
                              f"after {args.input_len} tokens of context (-d; TPOT = 1 / its tok/s)"}.get(
            b.latency_method,
            "a 1-token run (TTFT) and the full run of the same prompt (TPOT = the difference / (output - 1))")
        print(f"{b.name} TTFT and TPOT from {how}")
    result: dict[str, Any] = {**vllm_latency_keys(all_runs["modserve"]), "runs": runs,
                              **{f"{b.name}_runs": figures[b.name] for b in baselines}}
    if idle is not None:
        print(bubble_line(idle, llm.config.pipeline_in_flight))
        result["pipeline_idle_fraction"] = idle
    hw_name = args.hardware or ("cpu" if llm.config.device == "cpu" else None)
    if hw_name and args.batch_size > 1:  # the ceilings below are a single stream's
        print(f"no {hw_name} ceiling: it is computed for a single stream (--batch-size 1)")
    elif hw_name:
        dtype = _gemm_dtype(llm)
        kv_dtype = "fp8" if llm.config.kv_cache_dtype == "fp8_e4m3" else None
        shape, hw = ModelShape.load(llm.config.model), hardware(hw_name, dtype)  # the CPU's measured once
        p = plan(shape, hw, dtype, kv_dtype,
                 context_len=args.input_len + args.output_len // 2,
                 # what a decode step reads: quantized or not, a 16-bit decode copy if one is kept
                 weight_bytes=llm.decode_weight_bytes)
        rate = Spread.of([r["decode tok/s"] for r in runs]).median
        print(f"decode {rate:.1f} tok/s = {rate / p.decode_ceiling_tok_s:.0%} of the {hw_name} single-stream "
              f"ceiling of {p.decode_ceiling_tok_s:.1f} tok/s ({p.bandwidth / 1e9:.1f} GB/s over "
              f"{p.weight_bytes / 2**20:.0f} MiB of weights + KV per step)")
        result["ceiling_tok_s"] = p.decode_ceiling_tok_s
        ttft = Spread.of([r["TTFT ms"] for r in runs]).median / 1e3
        prefill = compute_fraction(shape, hw, dtype, [(args.input_len, 1)], ttft)
        print(prefill.line(hw_name, f"prefill of {args.input_len} tokens (TTFT)"))
        result["prefill_compute_ceiling_fraction"] = prefill.fraction
    _write_json(output_path(args, "latency"), result)
    return 0


# -- server -----------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import httpx

    from modserve.bench.metrics import parse_slos
    from modserve.bench.report import spread_table
    from modserve.bench.serve_client import ServeSettings, headline, request_headers, run, vllm_result
    from modserve.bench.workloads import load_workload

    slos = parse_slos(args.goodput)
    headers = request_headers(args.header, os.environ.get("OPENAI_API_KEY"))
    repeats = serve_repeats(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    pinning = pin(args)
    tokenizer = None
    # as vLLM's bench: --model is the tokenizer too when it is a checkpoint directory
    tokenizer_dir = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    requests = load_workload(args, tokenizer)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    urls = dict(zip(args.names, [base_url, args.baseline_url])) if args.baseline_url else {"server": base_url}
    model = args.served_model_name or args.model
    settings = {name: ServeSettings(url, endpoint, model, args.request_rate, args.burstiness,
                                    args.max_concurrency, args.warmups, slos, args.seed, args.request_timeout,
                                    headers=headers, percentile_metrics=args.percentile_metrics,
                                    percentiles=args.metric_percentiles)
                for name, url in urls.items()}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
    try:
        for i in range(repeats):  # interleaved: A, B, A, B, ... with the same arrivals per pair
            for name, s in settings.items():
                s.seed = args.seed + i
                results[name].append(run(s, requests))
    except (OSError, RuntimeError, httpx.HTTPError) as e:  # no server there, or it refused the warm-up
        print(f"error: {s.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for name, url in urls.items():
        first = results[name][0]
        print(f"{name}: {url}{endpoint}, model {first['model']}")
    first = next(iter(results.values()))[0]
    rate = "all at once" if first["request_rate"] is None else f"{first['request_rate']} req/s"
    print(f"client: {pinning}")
    print(f"workload: {args.workload}, {len(requests)} requests; arrivals {rate}, burstiness "
          f"{args.burstiness}, max concurrency {args.max_concurrency or 'unlimited'}")
    runs = [r for per_server in results.values() for r in per_server]
    failed = sum(r["failed"] for r in runs)
    print(f"completed {sum(r['completed'] for r in runs)}, failed {failed}" +
          (f" (first error: {_first_error(runs)})" if failed else ""))
    if slos:
        print("goodput SLOs: " + ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slos.items()))
    print(f"median [min-max] over {repeats} runs" + (", ratios per interleaved pair" if len(urls) == 2 else ""))
    print(spread_table({name: [headline(r, args.percentile_metrics, args.metric_percentiles) for r in per_server]
                        for name, per_server in results.items()}, digits=1))
    if args.baseline_url:
        from modserve.bench.report import plot_compare

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_compare(args.plot, {name: serve_latencies(per_server) for name, per_server in results.items()},
                     {name: [r["output_throughput"] for r in per_server] for name, per_server in results.items()},
                     f"bench serve: {' vs '.join(results)} on {args.model or first['model']}")
        print(f"wrote {args.plot}")
    saved = {name: {**vllm_result(per_server), "runs": per_server} for name, per_server in results.items()}
    _write_json(output_path(args, "serve"), saved if args.baseline_url else saved["server"])
    return 0 if not failed else 1


def serve_repeats(args: argparse.Namespace) -> int:
    """``--repeats``, else vLLM's single run; against ``--baseline-url`` 3 interleaved pairs, so
    that the ratio has a spread."""
    if args.repeats is not None:
        return args.repeats
    return 3 if args.baseline_url else 1


def serve_latencies(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Every successful request's TTFT and E2E, and every inter-token gap, over all runs (s)."""
    done = [req for r in runs for req in r["requests"] if not req["error"]]
    return {"TTFT": [req["ttft"] for req in done], "ITL": [x for req in done for x in req["itl"]],
            "E2E": [req["e2el"] for req in done]}


def _first_error(results: list[dict[str, Any]]) -> str:
    return next(req["error"] for r in results for req in r["requests"] if req["error"])


# -- compare and plan ---------------------------------------------------------------------
def cmd_compare(args: argparse.Namespace) -> int:
    from modserve import LLM
    from modserve.bench.compare import compare, labels_for, verdict, write_report
    from modserve.bench.workloads import load_workload, tokenize
    from modserve.cli import engine_overrides, log_selection
    from modserve.config_files import load_config_file
    from modserve.vllm_compat import engine_config

    if args.min_task_accuracy_delta is not None and not args.eval_task:
        print("compare: --min-task-accuracy-delta needs --eval-task FILE (the task it gates)", file=sys.stderr)
        return 2
    if args.max_perplexity_ratio is not None and not args.eval_text:
        print("compare: --max-perplexity-ratio needs --eval-text FILE (the text it gates)", file=sys.stderr)
        return 2
    if args.eval_task:  # a bad task file fails before any engine loads
        from modserve.bench.evaluate import TaskFileError, load_task

        try:
            load_task(args.eval_task)
        except TaskFileError as e:
            print(f"compare: {e}", file=sys.stderr)
            return 2
    pinning = pin(args)
    overrides = engine_overrides(args)  # the engine flags, applied to both
    configs = [engine_config(load_config_file(path), **overrides) for path in (args.config_a, args.config_b)]
    if all(c.tensor_parallel_size * c.pipeline_parallel_size > 1 for c in configs):
        # Both engines live in this process, interleaved, and torch.distributed has one default group.
        print("compare: A and B both run several ranks (tensor_parallel_size x pipeline_parallel_size > 1); "
              "they share this process, which holds one process group: give one of them a single rank, "
              "or run `modserve bench throughput` for each", file=sys.stderr)
        return 2
    for label, config in zip("AB", configs):
        log_selection(config, label)
    llm_a, llm_b = (LLM(config=c, progress=False) for c in configs)
    tok = llm_a.get_tokenizer()
    requests = tokenize(load_workload(args, tok), tok)
    labels = labels_for(args.config_a, args.config_b)
    result = compare(llm_a, llm_b, labels, requests, args.repeats, args.warmups,
                     args.probe_prompts, args.probe_tokens)
    if args.eval_task or args.eval_text:
        from modserve.bench.compare import evaluate_quality

        max_length = args.eval_max_length or min(1024, *(x.limits.max_model_len - 1 for x in (llm_a, llm_b)))
        result.quality = evaluate_quality(dict(zip(labels, (llm_a, llm_b))), args.eval_task, args.eval_text,
                                          max_length, args.eval_stride)
    failures = verdict(result, args.min_agreement, args.max_logit_diff, args.min_task_accuracy_delta,
                       args.max_perplexity_ratio)
    context = [f"`{labels[0]}`: {_changed(configs[0], configs[1])}",
               f"`{labels[1]}`: {_changed(configs[1], configs[0])}",
               *(f"- {line}" for line in _header(llm_a, pinning)),
               f"- {_workload_line(args, requests)}"]
    path = write_report(result, args.out_dir, f"A/B: {labels[0]} vs {labels[1]}", context, failures,
                        model=Path(configs[0].model).name)
    print(path.read_text())
    print(f"wrote {path} and {path.with_suffix('.png')}")
    if failures:
        print("compare FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def _changed(config: Any, other: Any) -> str:
    """The settings in which one config differs from the other."""
    a, b = config.model_dump(), other.model_dump()

    def show(value: Any) -> str:  # a plugin choice without options reads as its name
        if isinstance(value, dict) and set(value) == {"name", "options"} and not value["options"]:
            return value["name"]
        return str(value)

    return ", ".join(f"{k}={show(v)}" for k, v in a.items() if b.get(k) != v) or "(same settings)"


def cmd_plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from modserve.bench.plan import (MeasuredCollectives, ModelShape, disaggregation, hardware, interconnect,
                                     normalize_dtype, pipeline, plan, tp_comms)

    shape = ModelShape.load(args.model)
    dtype = normalize_dtype(args.dtype or shape.dtype)
    weight_bytes = None
    if args.quantization:
        import torch

        from modserve.runner.quantization import planned_weight_bytes

        model_dir = Path(args.model).parent if Path(args.model).is_file() else args.model
        weight_bytes = planned_weight_bytes(model_dir, args.quantization, getattr(torch, dtype),
                                            "cpu" if args.hardware == "cpu" else "cuda")
    hw = hardware(args.hardware, dtype)
    result = plan(shape, hw, dtype, args.kv_dtype, args.tp, args.context_len,
                  args.memory_fraction, weight_bytes, args.quantization)
    extra: dict[str, Any] = {}
    if args.tp > 1:
        link = interconnect(args.interconnect, args.hardware, args.allreduce_json)
        single = plan(shape, hw, dtype, args.kv_dtype, 1, args.context_len, args.memory_fraction, weight_bytes,
                      args.quantization)
        notes = []
        if isinstance(link, MeasuredCollectives) and link.world_size != args.tp:
            notes.append(f"all-reduce times measured at world size {link.world_size}, used as they are "
                         f"for TP={args.tp}")
        if isinstance(link, MeasuredCollectives) and (link.device == "cpu") != (args.hardware == "cpu"):
            notes.append(f"collectives measured on {link.device}, reads and math from {args.hardware}: a what-if")
        if args.hardware == "cpu":
            notes.append(f"{args.tp} ranks on one CPU share its memory bandwidth: the TP={args.tp} reads "
                         f"are optimistic")
        note = "; ".join(notes)
        extra["tp_comms"] = tp_comms(shape, single, result, link, args.batch_size, note)
    if args.pp > 1:
        extra["pipeline"] = pipeline(shape, result, args.pp, args.micro_batches, args.batch_size)
    if args.disaggregate:
        if args.input_len is None or args.output_len is None:
            raise ValueError("--disaggregate needs --input-len and --output-len")
        link = interconnect(args.interconnect, args.hardware, args.allreduce_json)
        extra["disaggregation"] = disaggregation(shape, result, link, args.input_len, args.output_len,
                                                 args.batch_size, args.request_rate)
    elif args.input_len is not None or args.output_len is not None or args.request_rate is not None:
        raise ValueError("--input-len, --output-len and --request-rate size disaggregated pools: add --disaggregate")
    if args.json:
        out = asdict(result)
        for key, part in extra.items():
            out[key] = {**asdict(part), **derived(key, part)}
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(result.lines() + [line for part in extra.values() for line in part.lines()]))
    return 0


def derived(key: str, part: Any) -> dict[str, Any]:
    """The properties of a plan's part, which asdict leaves out, for --json."""
    if key == "tp_comms":
        return {"comms_s": part.comms_s, "step_s": part.step_s, "worth_it": part.worth_it, "verdict": part.verdict()}
    if key == "pipeline":
        return {"bubble": part.bubble}
    return {"ratio": part.ratio, "ttft_s": part.ttft_s, "prefill_instances": part.prefill_instances,
            "decode_instances": part.decode_instances, "sizing": part.sizing()}


def cmd_collectives(args: argparse.Namespace) -> int:
    from modserve.bench import collectives

    where = pin(args)
    max_bytes = args.max_bytes or (64 if args.device == "cuda" else 16) * 2**20
    sizes = collectives.message_sizes(args.min_bytes, max_bytes, args.factor)
    gathers = args.gather_bytes or collectives.gather_sizes(args.min_bytes, max_bytes)
    data = collectives.measure(args.world_size, args.device, sizes, gathers, args.dtype, args.warmups, args.repeats)
    data["meta"]["pinning"] = where
    print("\n".join(collectives.lines(data)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    _write_json(args.json, data)
    if args.plot:
        why = collectives.plot(data, args.plot)
        print(why or f"wrote {args.plot}", file=sys.stderr if why else sys.stdout)
    return 0
