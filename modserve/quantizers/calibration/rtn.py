"""Round to nearest: a float checkpoint's decoder linears quantized with no calibration data,
the baseline calibrated AWQ and GPTQ are measured against (``modserve quantize --rtn``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from modserve.quantizers.calibration.formats import (
    QUANTIZED_LINEARS, awq_quantize, awq_tensors, gptq_quantize, gptq_tensors, quantization_config,
    write_checkpoint,
)

# g_idx_of(module, kind, in_features) -> [in_features] int32 group of each input channel.
GroupIndex = Callable[[str, str, int], torch.Tensor]


def round_to_nearest_checkpoint(src: str | os.PathLike, out_dir: str | os.PathLike, method: str, bits: int = 4,
                                group_size: int = 128, desc_act: bool = False, checkpoint_format: str = "gptq",
                                g_idx_of: GroupIndex | None = None) -> Path:
    """Copy float checkpoint ``src`` with every decoder linear quantized (``method``: awq or
    gptq); embeddings, norms, biases and lm_head stay as they are. GPTQ groups run in channel
    order unless ``g_idx_of`` gives another (an act-order layout needs one)."""
    from safetensors.torch import load_file

    src, out = Path(src), Path(out_dir)
    quantized: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, w in load_file(file).items():
            module, _, leaf = name.rpartition(".")
            kind = module.rpartition(".")[2]
            if leaf != "weight" or kind not in QUANTIZED_LINEARS:
                continue  # embeddings, norms, biases, lm_head: written as they are
            if method == "awq":
                quantized.update(awq_tensors(module, *awq_quantize(w, group_size)))
                continue
            k = w.shape[1]
            g_idx = g_idx_of(module, kind, k) if g_idx_of else torch.arange(k, dtype=torch.int32) // group_size
            quantized.update(gptq_tensors(module, *gptq_quantize(w, bits, group_size, g_idx), g_idx, bits,
                                          checkpoint_format))
    write_checkpoint(src, out, quantized, quantization_config(method, bits, group_size, desc_act, checkpoint_format))
    return out
