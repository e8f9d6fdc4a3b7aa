"""transformers as the oracle: greedy continuations and prefill logits of a checkpoint, in float32."""

from __future__ import annotations

import torch

# 8 prompts of different lengths: ASCII, accents and CJK and emoji, JSON, code, a single letter.
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "café naïve 日本語 😀 and then",
    "{\"model\": \"token\", \"cache\": [1, 2, 3]}",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
    "a",
    "Zürich Kraków Málaga " * 7,
    "def step(self):\n    return self.queue.pop()\n" * 3,
]



def greedy_and_logits(path: str, prompts: list[str], max_new: int
                      ) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """(prompt ids, exactly ``max_new`` greedy tokens, prefill logits ``[P, V]``) per prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in prompts]
    outs, logits = [], []
    with torch.no_grad():
        for p in ids:
            gen = model.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
            logits.append(model(torch.tensor([p])).logits[0])  # [P, V]
    return ids, outs, logits
