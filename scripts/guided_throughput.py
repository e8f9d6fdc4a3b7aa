"""What structured outputs cost: decode throughput with a JSON schema on half the batch
versus none, and the time to reuse a cached schema.

    .venv/bin/python scripts/guided_throughput.py [--preset small] [--backend xgrammar]

Each configuration runs ``--repeats`` times, alternating, and the best run counts
(the least disturbed by whatever else shares the machine). The schema's one
free-text field keeps random-weight outputs going to ``max_tokens``, so both runs
decode the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import time

from modserve import LLM, SamplingParams, StructuredOutputs
from modserve.testing import cached_checkpoint

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "text": {"type": "string"}},
          "required": ["id", "text"]}


def run(llm: LLM, batch: int, max_tokens: int, constrained: bool) -> float:
    """Output tokens per second of one batch."""
    params = []
    for i in range(batch):
        so = StructuredOutputs(json=SCHEMA) if constrained and i % 2 == 0 else None
        params.append(SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=so is None,
                                     structured_outputs=so))
    start = time.perf_counter()
    outs = llm.generate(["Describe the weather in JSON:"] * batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def reuse_cost(llm: LLM, reps: int = 2000) -> float:
    """Seconds to fetch a compiled schema from the cache and make a matcher for it."""
    grammar = llm.engine.grammar
    spec = StructuredOutputs(json=SCHEMA).spec()
    grammar.compile(spec)
    start = time.perf_counter()
    for _ in range(reps):
        grammar.submit(StructuredOutputs(json=SCHEMA).spec()).result().matcher()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="random-weight llama preset (modserve.testing)")
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    llm = LLM(str(cached_checkpoint("llama", args.preset)), progress=False, grammar_backend=args.backend,
              kv_cache_memory_gb=1.0, max_model_len=512, num_threads=args.threads)
    start = time.perf_counter()
    llm.engine.grammar.compile(StructuredOutputs(json=SCHEMA).spec())
    first_compile = time.perf_counter() - start
    run(llm, 4, 8, True)  # warm-up
    plain, guided = [], []
    for _ in range(args.repeats):
        plain.append(run(llm, args.batch, args.max_tokens, False))
        guided.append(run(llm, args.batch, args.max_tokens, True))
    result = {
        "preset": args.preset, "backend": args.backend, "batch": args.batch, "max_tokens": args.max_tokens,
        "unconstrained_tok_s": round(max(plain), 1), "half_constrained_tok_s": round(max(guided), 1),
        "ratio": round(max(guided) / max(plain), 3), "runs_unconstrained": [round(x, 1) for x in plain],
        "runs_half_constrained": [round(x, 1) for x in guided],
        "first_compile_ms": round(first_compile * 1e3, 2), "cached_reuse_ms": round(reuse_cost(llm) * 1e3, 4),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
