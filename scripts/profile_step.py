"""Where an engine step's time goes: a workload under cProfile, summed by part.

Runs one untimed pass (warm-up, compiles), then the workload under cProfile, and
splits the engine's time into the parts of a step: scheduling, batch preparation
(input tensors, sampling tensors, the attention backend's per-step plan), the model's
layers (GEMMs, norms, RoPE, MLP; compiled or not) without attention, attention, the
CPU platform's native decode steps (layers and attention in one C++ call), logits,
sampling, detokenization, and the rest of the engine's Python (output
bookkeeping, stop checks). cProfile slows Python more than native code, so the
Python parts read somewhat high; the split, not the total, is the figure.

    .venv/bin/python scripts/profile_step.py --model build/ref-small --single-stream
    .venv/bin/python scripts/profile_step.py --model build/ref-small \\
        --workload modserve/bench/data/reference-64.jsonl --compile off
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

def parts_of_a_step(llm) -> dict[str, list]:
    """part -> the functions whose cumulative time it is."""
    from modserve.engine import engine, scheduler, tokenizer
    from modserve.runner import model_runner

    runner = llm.engine.runner
    attn, model = type(runner.attn), type(runner.model)
    native = runner.step_forward  # the platform's native step, where it runs one
    logits = runner.model.compute_logits  # the platform's native LM head, where it runs one
    return {
        "native decode step": [type(native).__call__] if hasattr(native, "decoder") else [],
        "step": [engine.LLMEngine.step],
        "scheduling": [scheduler.SchedulerCore.step],
        "batch preparation": [model_runner.ModelRunner._prepare, model_runner.ModelRunner.sampling_batch,
                              attn.prepare],
        "model": [model.forward],
        "attention": [attn.forward],
        "logits": [model.compute_logits] + ([type(logits).__call__] if hasattr(logits, "op") else []),
        "sampling": [type(runner.sampler).__call__],
        "detokenization": [tokenizer.IncrementalDecoder.step],
    }


def cumulative(stats: pstats.Stats, functions: list) -> float:
    """Sum of the cumulative times of ``functions`` (cProfile's cumulative time already
    counts a re-entered function once)."""
    keys = {(f.__code__.co_filename, f.__code__.co_firstlineno, f.__code__.co_name) for f in functions}
    return sum(ct for key, (_, _, _, ct, _) in stats.stats.items() if key in keys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", help="JSONL with prompt_token_ids and output_len (reference-64 format)")
    ap.add_argument("--single-stream", action="store_true", help="one 128-token prompt, 128 tokens out")
    ap.add_argument("--compile", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the split here")
    ap.add_argument("--native-decode", choices=["on", "off"], default="on",
                    help="the cpu platform's native decode step (off: the compiled forward)")
    args = ap.parse_args()
    from modserve import LLM, SamplingParams

    extra = {} if args.compile == "auto" else {"compile": args.compile}  # older versions had no such key
    platform = {"name": "cpu", "options": {"native_decode": args.native_decode == "on"}}
    llm = LLM(args.model, progress=False, num_threads=args.threads, platform=platform, **extra)
    if args.single_stream or not args.workload:
        prompts, lens = [list(range(100, 228))], [128]
    else:
        rows = [json.loads(line) for line in open(args.workload) if line.strip()]
        prompts, lens = [r["prompt_token_ids"] for r in rows], [r["output_len"] for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    parts = {name: cumulative(stats, functions) for name, functions in parts_of_a_step(llm).items()}
    if parts["native decode step"]:
        parts["native decode step"] -= parts["model"]  # the steps it hands back to the forward
    parts["model"] -= parts["attention"]  # attention runs inside the layers
    step = parts.pop("step")
    parts["engine Python (rest of the step)"] = step - sum(parts.values())
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.model}: {len(prompts)} request(s), {tokens} tokens in {wall:.1f} s under cProfile; "
          f"compile {getattr(llm.engine.runner, 'compiled', False)}, {llm.engine.stats()['steps']} steps")
    print("| part | s | share |\n|---|---|---|")
    for name, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds:.2f} | {seconds / step:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall": wall, "tokens": tokens, "step_s": step, "parts": parts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
