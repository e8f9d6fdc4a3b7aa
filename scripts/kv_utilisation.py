"""Paged vs contiguous KV allocation on one workload and one KV budget.

Steps an engine by hand and records, every step, how many sequences run and how
much of the allocated KV holds real tokens. Prints a markdown table.

    python scripts/kv_utilisation.py [--model DIR] [--num-kv-blocks 256] [--max-model-len 1024]
"""

from __future__ import annotations

import argparse
import statistics

from modserve import LLM, SamplingParams
from modserve.bench.workloads import DEFAULT_WORKLOAD, custom_requests, tokenize
from modserve.testing import cached_checkpoint


def run(model: str, allocator: str, blocks: int, max_len: int, requests) -> dict[str, float]:
    llm = LLM(model, dtype="float32", num_kv_blocks=blocks, max_model_len=max_len, kv_allocator=allocator,
              progress=False)
    eng = llm.engine
    for i, r in enumerate(requests):
        eng.add_request(str(i), r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.output_len,
                                                                    ignore_eos=True))
    running, util = [], []
    while eng.has_unfinished_requests():
        eng.step()
        seqs = eng.scheduler.running
        used = sum(len(s.block_ids) for s in seqs) * eng.config.block_size
        if used:
            running.append(len(seqs))
            util.append(sum(s.num_computed_tokens for s in seqs) / used)
    return {"max running": max(running), "mean running": statistics.mean(running),
            "mean KV utilisation": statistics.mean(util), "steps": len(running)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the tiny random-weight Llama")
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=64)
    a = ap.parse_args()
    model = a.model or str(cached_checkpoint("llama"))
    tok = LLM(model, num_kv_blocks=a.num_kv_blocks, max_model_len=a.max_model_len, progress=False).get_tokenizer()
    requests = [r for r in tokenize(custom_requests(DEFAULT_WORKLOAD, a.num_prompts), tok)
                if len(r.prompt_token_ids) + r.output_len < a.max_model_len]
    print(f"{len(requests)} requests, {a.num_kv_blocks} blocks x 16 tokens, max_model_len {a.max_model_len}\n")
    print("| allocator | max running | mean running | mean KV utilisation | steps |\n|---|---|---|---|---|")
    for allocator in ("paged", "contiguous"):
        r = run(model, allocator, a.num_kv_blocks, a.max_model_len, requests)
        print(f"| {allocator} | {r['max running']} | {r['mean running']:.1f} | {r['mean KV utilisation']:.0%} | {r['steps']} |")


if __name__ == "__main__":
    main()
