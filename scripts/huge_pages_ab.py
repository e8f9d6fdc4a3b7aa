"""Single-stream decode with the weights in huge pages against 4 KiB pages, in one process.

Two engines on the same checkpoint, the cpu platform's ``huge_pages`` on and off, generate
the same greedy request in turn; the time per output token (TPOT) of each, median of the
rounds, and their ratio. Alternating in one process keeps the machine's drift out of the
ratio; the tokens must be the same.

    .venv/bin/python scripts/huge_pages_ab.py --model build/ref-small --rounds 8 [--quantization int8]
"""

from __future__ import annotations

import argparse
import statistics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--quantization", help="a quantizer's name (int8, ...)")
    args = ap.parse_args()
    from modserve import LLM, SamplingParams

    extra = {"quantization": args.quantization} if args.quantization else {}
    engines = {name: LLM(args.model, progress=False, kv_cache_memory_gb=1,
                         platform={"name": "cpu", "options": {"huge_pages": huge}}, **extra)
               for name, huge in (("huge pages", True), ("4 KiB pages", False))}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = [100 + i % 4000 for i in range(args.input_len)]
    tpot: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {}
    for llm in engines.values():  # warm-up
        llm.generate([prompt], [params], use_tqdm=False)
    for r in range(args.rounds):
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            out = llm.generate([prompt], [params], use_tqdm=False)[0]
            m = out.metrics
            tpot[name].append((m.finished_time - m.first_token_time) / (args.output_len - 1) * 1e3)
            tokens.setdefault(name, out.outputs[0].token_ids)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1]:.2f} ms" for n, t in tpot.items()), flush=True)
    if len(set(map(tuple, tokens.values()))) != 1:
        raise SystemExit("the two engines gave different tokens")
    print(f"\n{args.model}{' ' + args.quantization if args.quantization else ''}: TPOT median [min-max] over "
          f"{args.rounds} rounds, alternating in one process\n| weights in | TPOT ms |\n|---|---|")
    for name, ts in tpot.items():
        print(f"| {name} | {statistics.median(ts):.2f} [{min(ts):.2f}-{max(ts):.2f}] |")
    ratio = statistics.median(tpot["4 KiB pages"]) / statistics.median(tpot["huge pages"])
    print(f"huge pages decode {ratio:.3f}x as fast (same tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
