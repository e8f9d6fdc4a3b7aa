"""Single-stream decode with and without speculative decoding, interleaved repeats.

For each setting prints decode tokens/s (median [min-max]), output tokens per target
forward pass, and the draft acceptance rate. Greedy, EOS ignored, so every setting
produces the same tokens (checked).

    python scripts/spec_decode_speed.py [--model DIR] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

from modserve import LLM, SamplingParams
from modserve.testing import cached_checkpoint

# n-gram friendly: a pattern the model can keep repeating.
REPETITIVE = "def f(x):\n    return x + 1\n" * 6
PLAIN = "The history of the river valley begins with"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the 88M 'small' random-weight Llama")
    ap.add_argument("--draft", default=None, help="default: the 'small' Llama cut to 2 layers")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    model = a.model or str(cached_checkpoint("llama", "small"))
    draft = a.draft or str(cached_checkpoint("llama", "small", num_hidden_layers=2))
    settings = {
        "no speculation": None,
        "ngram k=4": {"proposer": "ngram", "num_speculative_tokens": 4},
        "draft = target, k=4": {"proposer": {"name": "draft_model", "options": {"model": model}},
                                "num_speculative_tokens": 4},
        "draft = smaller model, k=4": {"proposer": {"name": "draft_model", "options": {"model": draft}},
                                       "num_speculative_tokens": 4},
    }
    engines = {name: LLM(model, dtype="float32", num_kv_blocks=256, max_model_len=1024, speculative=spec,
                         progress=False) for name, spec in settings.items()}
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    for prompt_name, prompt in (("repetitive prompt", REPETITIVE), ("plain prompt", PLAIN)):
        rates: dict[str, list[float]] = {n: [] for n in settings}
        outputs: dict[str, list[int]] = {}
        for _ in range(a.repeats):
            for name, llm in engines.items():  # interleaved: machine drift hits all alike
                before = dict(llm.engine.stats())
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                t = out.metrics.token_times
                rates[name].append((len(t) - 1) / (t[-1] - t[0]))
                outputs[name] = out.outputs[0].token_ids
                after = llm.engine.stats()
                steps = after["steps"] - before["steps"] - 1  # minus the prefill step
                proposed = after.get("spec_proposed_tokens", 0) - before.get("spec_proposed_tokens", 0)
                accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
                rates[name + " per-step"] = [(a.tokens - 1) / steps]
                rates[name + " acceptance"] = [accepted / proposed if proposed else float("nan")]
        assert len({tuple(v) for v in outputs.values()}) == 1, "speculation changed greedy output"
        base = statistics.median(rates["no speculation"])
        print(f"\n{prompt_name}, {a.tokens} tokens, median [min-max] of {a.repeats}\n")
        print("| setting | decode tok/s | vs none | tokens per target pass | acceptance |\n|---|---|---|---|---|")
        for name in settings:
            r = rates[name]
            print(f"| {name} | {statistics.median(r):.1f} [{min(r):.1f}-{max(r):.1f}] | "
                  f"{statistics.median(r) / base:.2f}x | {rates[name + ' per-step'][0]:.2f} | "
                  f"{rates[name + ' acceptance'][0]:.0%} |")


if __name__ == "__main__":
    main()
