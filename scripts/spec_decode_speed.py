"""Greedy decode with and without speculative decoding, on the trained demo model, interleaved repeats.

Settings: no speculation, n-gram prompt lookup, the shipped 2-layer draft model; each with
``--k`` speculative tokens. Workloads: one stream, and ``--batch`` streams at once; prompts
are held-out text the models never trained on (verse openings, and a long passage to
continue, where earlier lines give n-gram lookup something to copy). For each it prints
decode tokens/s (median [min-max]), output tokens per target forward pass and the
acceptance rate. Greedy with EOS ignored, so every setting must give the same tokens (checked).

    python scripts/spec_decode_speed.py [--tokens 128] [--repeats 3] [--batch 8] [--k 4]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from modserve import LLM, SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "modserve" / "server" / "demo_model"


def prompts(batch: int) -> dict[str, list[str]]:
    lines = (DEMO / "heldout.txt").read_text().splitlines()
    openings = [" ".join(line.split()[:6]) for line in lines[:: len(lines) // batch][:batch]]
    # a passage of held-out lines, to be continued: the model sees 12 lines, writes the next
    passages = ["\n".join(lines[i: i + 12]) + "\n" for i in range(0, 12 * batch, 12)]
    return {"verse openings": openings, "a 12-line passage, continued": passages}


def decode_rate(outs) -> float:
    """Output tokens after the first, per second from the first token to the last (all streams)."""
    first = min(o.metrics.token_times[0] for o in outs)
    last = max(o.metrics.token_times[-1] for o in outs)
    return sum(len(o.metrics.token_times) - 1 for o in outs) / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO / "main"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    settings = {
        "no speculation": None,
        f"ngram, k={a.k}": {"proposer": "ngram", "num_speculative_tokens": a.k},
        f"draft model (2 layers), k={a.k}": {"proposer": {"name": "draft_model", "options": {"model": a.draft}},
                                             "num_speculative_tokens": a.k},
    }
    engines = {name: LLM(a.model, dtype=a.dtype, num_kv_blocks=512, max_model_len=1024, speculative=spec,
                         progress=False) for name, spec in settings.items()}
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    for prompt_name, texts in prompts(a.batch).items():
        for streams in (1, a.batch):
            batch = texts[:streams]
            rates: dict[str, list[float]] = {n: [] for n in settings}
            per_pass: dict[str, float] = {}
            acceptance: dict[str, float] = {}
            outputs: dict[str, list[tuple[int, ...]]] = {}
            for _ in range(a.repeats):
                for name, llm in engines.items():  # interleaved: machine drift hits all alike
                    before = dict(llm.engine.stats())
                    outs = llm.generate(batch, params, use_tqdm=False)
                    after = llm.engine.stats()
                    rates[name].append(decode_rate(outs))
                    outputs[name] = [tuple(o.outputs[0].token_ids) for o in outs]
                    passes = after["steps"] - before["steps"] - 1  # minus the prefill step
                    proposed = after.get("spec_proposed_tokens", 0) - before.get("spec_proposed_tokens", 0)
                    accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
                    per_pass[name] = (a.tokens - 1) / passes
                    acceptance[name] = accepted / proposed if proposed else float("nan")
            assert len({tuple(v) for v in outputs.values()}) == 1, "speculation changed greedy output"
            base = statistics.median(rates["no speculation"])
            print(f"\n{prompt_name}, {streams} stream(s), {a.tokens} tokens each, {a.dtype}, "
                  f"median [min-max] of {a.repeats}\n")
            print("| setting | decode tok/s | vs none | tokens per target pass (per stream) | acceptance |\n"
                  "|---|---|---|---|---|")
            for name in settings:
                r = rates[name]
                acc = "—" if acceptance[name] != acceptance[name] else f"{acceptance[name]:.0%}"
                print(f"| {name} | {statistics.median(r):.1f} [{min(r):.1f}-{max(r):.1f}] | "
                      f"{statistics.median(r) / base:.2f}x | {per_pass[name]:.2f} | {acc} |", flush=True)


if __name__ == "__main__":
    main()
