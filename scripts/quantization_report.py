"""The accuracy and memory tables of docs/quantization.md, for a random-weight test model.

    .venv/bin/python scripts/quantization_report.py --preset tiny
    .venv/bin/python scripts/quantization_report.py --preset small

Per method: prefill logits against the float32 model (max |difference|, mean KL per
position), greedy agreement, weight bytes as planned and as allocated; then KV tokens
that fit in a fixed budget with a float32, bfloat16 and fp8 cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_quantization import PROMPTS, logit_error, prefill_logits  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from modserve.runner.quantization import planned_weight_bytes  # noqa: E402
from modserve.testing import cached_checkpoint, cached_quantized_checkpoint  # noqa: E402

GROUP = {"tiny": 32, "small": 128}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    g = GROUP[args.preset]
    float_dir = str(cached_checkpoint("llama", args.preset))
    methods = {
        "float32": (float_dir, None, "auto"),
        "int8": (float_dir, "int8", "auto"),
        "fp8": (float_dir, "fp8", "auto"),
        f"awq (g{g})": (cached_quantized_checkpoint("awq", preset=args.preset, group_size=g), "awq", "auto"),
        f"gptq 4-bit (g{g})": (cached_quantized_checkpoint("gptq", preset=args.preset, group_size=g), "gptq", "auto"),
        f"gptq 4-bit act-order (g{g})": (cached_quantized_checkpoint("gptq", preset=args.preset, group_size=g,
                                                                      desc_act=True), "gptq", "auto"),
        f"gptq 8-bit (g{g})": (cached_quantized_checkpoint("gptq", preset=args.preset, group_size=g, bits=8),
                               "gptq", "auto"),
        "float32 + fp8 KV": (float_dir, None, "fp8_e4m3"),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    float_bytes = planned_weight_bytes(float_dir, None, torch.float32)
    bf16_bytes = planned_weight_bytes(float_dir, None, torch.bfloat16)
    rows, ref, ref_tokens = [], None, None
    for name, (path, quant, kv) in methods.items():
        llm = LLM(str(path), dtype="float32", quantization=quant, kv_cache_dtype=kv, num_kv_blocks=1024,
                  progress=False)
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        logits = prefill_logits(llm, ids)
        tokens = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
        if ref is None:
            ref, ref_tokens = logits, tokens
        max_abs, kl = logit_error(logits, ref)
        same = sum(a == b for t, r in zip(tokens, ref_tokens) for a, b in zip(t, r)) / sum(map(len, tokens))
        planned = planned_weight_bytes(str(path), quant, torch.float32)
        actual = llm.engine.runner.weight_bytes
        assert planned == actual, (name, planned, actual)
        bf16_elsewhere = planned_weight_bytes(str(path), quant, torch.bfloat16)
        rows.append(f"| {name} | {max_abs:.4f} | {kl:.1e} | {same:.0%} | {actual / 2**20:.2f} MiB "
                    f"({actual / float_bytes:.2f}x) | {bf16_elsewhere / 2**20:.2f} MiB ({bf16_elsewhere / bf16_bytes:.2f}x) |")
        del llm
    print(f"llama-{args.preset}, prompts of {[len(i) for i in ids]} tokens, greedy {args.max_tokens} tokens each")
    print("| method | max abs logit diff | mean KL | greedy tokens as float32 | weights, float32 elsewhere "
          "(vs float32) | weights, bfloat16 elsewhere (vs bfloat16) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    budget = 1.0
    print(f"\nKV tokens in {budget} GiB (engine, kv_cache_memory_gb={budget}):")
    for kv, dtype in (("auto", "float32"), ("auto", "bfloat16"), ("fp8_e4m3", "float32")):
        eng = LLM(float_dir, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gb=budget, progress=False).engine
        print(f"| {dtype if kv == 'auto' else 'fp8_e4m3'} | {eng.runner.kv_bytes_per_block() // eng.config.block_size} B/token "
              f"| {eng.num_blocks * eng.config.block_size:,} tokens |")


if __name__ == "__main__":
    main()
