"""PEFT LoRA adapters from a directory: ``adapter_config.json`` + ``adapter_model.safetensors``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from modserve.core.lora_request import LoRARequest

# The projections an adapter may target: a Llama-family decoder's (vLLM's default set)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights, by the checkpoint's module name (``layers.0.self_attn.q_proj``)."""

    request: LoRARequest
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def load_adapter(request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at ``request.lora_path``; a ValueError naming what it holds that is not supported."""
    where = Path(request.lora_path)
    name = f"LoRA adapter {request.lora_name!r} ({where})"
    config_file, weights_file = where / "adapter_config.json", where / "adapter_model.safetensors"
    if not config_file.is_file():
        raise ValueError(f"{name}: no adapter_config.json there (a PEFT adapter directory is expected)")
    if not weights_file.is_file():
        raise ValueError(f"{name}: no adapter_model.safetensors there (other weight files are not read)")
    cfg = json.loads(config_file.read_text())
    refuse = [why for why, bad in (
        (f"peft_type {cfg.get('peft_type')!r} (only LORA)", cfg.get("peft_type", "LORA") != "LORA"),
        ("use_dora (DoRA)", bool(cfg.get("use_dora"))),
        (f"bias {cfg.get('bias')!r} (only 'none')", cfg.get("bias", "none") != "none"),
        (f"modules_to_save {cfg.get('modules_to_save')}", bool(cfg.get("modules_to_save"))),
        ("rank_pattern / alpha_pattern (one rank for all modules only)",
         bool(cfg.get("rank_pattern")) or bool(cfg.get("alpha_pattern"))),
    ) if bad]
    if refuse:
        raise ValueError(f"{name}: not supported: {'; '.join(refuse)}")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if not 0 < rank <= max_lora_rank:
        raise ValueError(f"{name}: rank r={rank} is over max_lora_rank={max_lora_rank}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    from safetensors.torch import load_file

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        # base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
        module, _, kind = key.removeprefix("base_model.model.").removeprefix("model.").rpartition(".lora_")
        if kind not in ("A.weight", "B.weight") or module.rpartition(".")[2] not in TARGETS:
            raise ValueError(f"{name}: tensor {key!r} is not supported (targets: {', '.join(TARGETS)}; "
                             "no embedding or lm_head adapters, no DoRA magnitudes)")
        pairs.setdefault(module, {})[kind[0]] = tensor
    weights = {}
    for module, pair in pairs.items():
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{name}: module {module!r} lacks lora_A or lora_B of rank {rank}")
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"{name}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(request, rank, scaling, weights)
