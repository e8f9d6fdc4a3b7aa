"""Which quantizer an engine runs, and what its weights and KV cache will weigh.

Selection: ``quantization:`` from the engine config, else the checkpoint's
``quantization_config.quant_method`` (the quantizer registered under that name). When
both are given they must agree: the configured quantizer must read that ``quant_method``
(its ``checkpoint_methods``); a mismatch is an error naming both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from modserve.core.config import PluginChoice
from modserve.core.contracts.quantizer import Quantizer
from modserve.runner.linear import default_dtype, linear_factory, planned_model_bytes
from modserve.core.registry import Registry

KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def select_quantizer(choice: PluginChoice | None, hf_config: Any, registry: Registry) -> Quantizer | None:
    ckpt = checkpoint_quant_config(hf_config)
    method = ckpt.get("quant_method") if ckpt else None
    if choice is None and method is None:
        return None
    if choice is None:
        try:
            registry.get("quantizer", method)
        except ValueError as e:
            raise ValueError(f"the checkpoint's quantization_config.quant_method {method!r} has no quantizer: "
                             f"{e}") from None
        choice = PluginChoice(name=method)
        source = f"the checkpoint's quant_method {method!r}"
    else:
        source = f"quantization {choice.name!r} (config)"
    reads = tuple(getattr(registry.load("quantizer", choice.name), "checkpoint_methods", ()))
    if method is not None and method not in reads:
        what = f"reads {', '.join(reads)} checkpoints" if reads else "quantizes float checkpoints at load"
        raise ValueError(f"{source} does not match the checkpoint's quantization_config.quant_method "
                         f"{method!r}: quantizer {choice.name!r} {what}")
    if method is None and reads:
        raise ValueError(f"{source} reads pre-quantized checkpoints (quant_method {', '.join(reads)}), "
                         "but this checkpoint has no quantization_config")
    return registry.create("quantizer", choice, ckpt if method else None)


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for ``kv_cache_dtype: name`` (auto: the compute dtype)."""
    return dtype if name == "auto" else KV_CACHE_DTYPES[name]


def planned_weight_bytes(model_dir: str | Path, quantization: str | dict | None, dtype: torch.dtype,
                         device: torch.device | str = "cpu", registry: Registry | None = None) -> int:
    """Bytes the engine will hold for this checkpoint's weights: the model built on "meta",
    each linear as its quantizer plans it, everything else (embeddings, norms, lm_head) in ``dtype``."""
    from modserve.runner.loader import load_hf_config
    from modserve.core.registry import get_registry

    registry = registry or get_registry()
    hf_config = load_hf_config(model_dir)
    choice = PluginChoice.model_validate(quantization) if quantization else None
    quantizer = select_quantizer(choice, hf_config, registry)
    model_cls = registry.load("model_architecture", hf_config.architectures[0])
    with torch.device("meta"), default_dtype(dtype):
        model = model_cls(hf_config, None, 1, make_linear=linear_factory(quantizer, dtype, torch.device(device)))
    return planned_model_bytes(model)
