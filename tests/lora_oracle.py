"""PEFT adapters with random weights, and transformers + peft as the oracle (float32 greedy)."""

from __future__ import annotations

from pathlib import Path

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, out: Path, r: int, targets: list[str], seed: int, alpha: int = 16,
                 rslora: bool = False) -> str:
    """A PEFT adapter of ``base`` at ``out``: every lora_A and lora_B random (B non-zero), seeded."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out / "adapter_model.safetensors").is_file():
        return str(out)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                  use_rslora=rslora, lora_dropout=0.0, bias="none"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(str(out))
    return str(out)


def peft_greedy(base: str, adapter: str | None, ids: list[list[int]], max_new: int
                ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and the prefill logits ``[P, V]`` of each prompt, base + adapter (None: base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs, logits = [], []
    with torch.no_grad():
        for p in ids:
            gen = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
            logits.append(model(input_ids=torch.tensor([p])).logits[0])
    return outs, logits
