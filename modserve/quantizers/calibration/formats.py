"""The AWQ (GEMM) and GPTQ checkpoint formats as AutoAWQ and AutoGPTQ / GPTQModel write them:
the integer grids, the int32 packing, the ``quantization_config`` and the checkpoint folder. Written independently of
the engine's unpacking (modserve/quantizers/packing.py), so tests can hold one against the other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "w1", "w2", "w3")  # w1/w3/w2: Mixtral's experts' gate/up/down; routers stay float
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # int32 nibble i holds output channel AWQ_PACK_ORDER[i] of 8


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack ``32 // bits`` unsigned ints per int32 along ``dim`` (lowest bits first), value
    ``order[i]`` of each run of ``32 // bits`` going to slot ``i`` (default: in order)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)  # [..., C / per, per]
    if order is not None:
        v = v[..., list(order)]
    words = sum(v[..., i] << (bits * i) for i in range(per))
    return _to_int32(words).movedim(-1, dim).contiguous()


def awq_quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ's zero-point round-to-nearest: ``w [N, K]`` -> (q ``[K, N]``, zeros ``[K/g, N]``,
    scales ``[K/g, N]`` float16) with ``w.T ≈ (q - zeros[k // g]) * scales[k // g]``."""
    wt = w.float().t()  # [K, N]
    k, n = wt.shape
    grouped = wt.reshape(k // group_size, group_size, n)
    lo, hi = grouped.amin(dim=1), grouped.amax(dim=1)  # [K/g, N]
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = torch.clamp(-torch.round(lo / s), 0, 15)
    q = torch.clamp(torch.round(grouped / s[:, None]) + zeros[:, None], 0, 15)
    return q.reshape(k, n).int(), zeros.int(), scales


def gptq_quantize(w: torch.Tensor, bits: int, group_size: int, g_idx: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's symmetric grid, rounded to nearest: ``w [N, K]`` -> (q ``[K, N]``, zeros, scales
    ``[groups, N]``) with ``w.T ≈ (q - zeros[g_idx]) * scales[g_idx]``; zeros are 2**(bits-1)."""
    wt = w.float().t()  # [K, N]
    maxq = 2**bits - 1
    groups = int(g_idx.max()) + 1
    amax = torch.stack([wt[g_idx == i].abs().amax(dim=0) for i in range(groups)])  # [groups, N]
    scales = (2 * amax.clamp(min=1e-5) / maxq).half()
    zeros = torch.full_like(amax, (maxq + 1) // 2).int()
    s = scales.float()[g_idx.long()]  # [K, N]
    q = torch.clamp(torch.round(wt / s) + zeros[g_idx.long()], 0, maxq)
    return q.int(), zeros, scales


def quantization_config(method: str, bits: int, group_size: int, desc_act: bool = False,
                        checkpoint_format: str = "gptq", damp_percent: float = 0.01) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for ``method`` (awq or gptq)."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": True,
                "checkpoint_format": checkpoint_format, "static_groups": False, "true_sequential": True,
                "damp_percent": damp_percent}
    raise ValueError(f"unknown method {method!r}; expected awq or gptq")


def awq_tensors(module: str, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear's AWQ tensors from ``q [K, N]``, ``zeros``, ``scales [K/g, N]``."""
    return {f"{module}.qweight": pack_int32(q, 4, dim=1, order=AWQ_PACK_ORDER),  # [K, N/8]
            f"{module}.qzeros": pack_int32(zeros, 4, dim=1, order=AWQ_PACK_ORDER),  # [K/g, N/8]
            f"{module}.scales": scales}  # [K/g, N] float16


def gptq_tensors(module: str, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """One linear's GPTQ tensors from ``q [K, N]``, ``zeros``, ``scales [groups, N]``, ``g_idx [K]``."""
    stored = zeros - 1 if checkpoint_format == "gptq" else zeros  # v1 stores zero - 1
    return {f"{module}.qweight": pack_int32(q, bits, dim=0),  # [K / pack, N]
            f"{module}.qzeros": pack_int32(stored, bits, dim=1),  # [groups, N / pack]
            f"{module}.scales": scales,  # [groups, N]
            f"{module}.g_idx": g_idx}  # [K]


def write_checkpoint(src: Path, out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write ``out``: float checkpoint ``src`` with ``tensors`` in place of its own (a linear
    whose ``qweight`` is among them loses its float ``weight``; other names replace or add),
    its other files copied and ``config`` as its ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        # modserve_key.json: the cache key of modserve.testing's checkpoint cache, not the model's.
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("modserve_key.json", "config.json"):
            shutil.copy(f, out / f.name)
    written: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, w in load_file(file).items():
            if f"{name.removesuffix('.weight')}.qweight" not in tensors:
                written[name] = tensors.get(name, w)
    written.update({k: v.contiguous() for k, v in tensors.items() if k not in written})
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    model_config = json.loads((src / "config.json").read_text())
    model_config["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(model_config, indent=2))
