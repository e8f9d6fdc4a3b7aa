"""Capacity planning from a model's shape and a device's datasheet (or this CPU, measured).

The arithmetic, per device with tensor parallelism ``tp``:

- weight bytes = parameters x bytes per weight / tp
- KV bytes per token = 2 (K and V) x layers x ceil(KV heads / tp) x head dim x bytes per KV value
- KV tokens that fit = (memory x memory_fraction - weight bytes) / KV bytes per token
- single-stream decode ceiling = bandwidth / (weight bytes + context x KV bytes per token):
  each decode step reads every weight (and the context's KV) once
- compute-bound batch B: decode with B sequences does 2 x params / tp FLOPs per sequence
  and reads the weights once plus each sequence's KV, so it turns compute-bound where
  2 P B / F = (W + B c k) / BW, i.e. B = (W / BW) / (2 P / F - c k / BW)
- prefill time per 1k tokens = (2 x params x 1000 + causal attention 2 L H d 1000^2) / (tp x F)

Dense Llama-family models only (no mixture of experts). Datasheet figures are dense
(no sparsity) tensor-core rates and HBM bandwidths of the SXM parts, decimal units.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "float8": "fp8", "float8_e4m3fn": "fp8", "fp8_e4m3": "fp8"}


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    memory: float  # bytes
    bandwidth: float  # bytes/s
    flops_16: float  # dense bf16/fp16 tensor FLOP/s
    flops_8: float | None  # dense fp8 FLOP/s; None when the device has no fp8 math
    flops_32: float  # dense fp32 FLOP/s (no TF32)

    def flops(self, dtype: str) -> float:
        # fp8 weights with fp8 activations run at the fp8 rate; weight-only int8/int4
        # dequantize to 16-bit and run at that rate.
        if dtype == "fp8" and self.flops_8:
            return self.flops_8
        return self.flops_32 if dtype == "float32" else self.flops_16


HARDWARE = {
    "h100": Hardware("h100", 80e9, 3.35e12, 989e12, 1979e12, 67e12),
    "h200": Hardware("h200", 141e9, 4.8e12, 989e12, 1979e12, 67e12),
    "b200": Hardware("b200", 180e9, 8.0e12, 2250e12, 4500e12, 75e12),
    "a100-80g": Hardware("a100-80g", 80e9, 2.039e12, 312e12, None, 19.5e12),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "bfloat16"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "ModelShape":
        heads = cfg["num_attention_heads"]
        dtype = normalize_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return cls(
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")), dtype=dtype)

    @classmethod
    def load(cls, path: str | Path) -> "ModelShape":
        """From a checkpoint directory or its config.json."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no config.json at {path}")
        return cls.from_config(json.loads(file.read_text()))

    @property
    def num_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        per_layer = attn + mlp + 2 * h  # two RMSNorms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h  # final norm


@dataclass(frozen=True, slots=True)
class Plan:
    hardware: str
    tp: int
    dtype: str
    kv_dtype: str
    context_len: int
    num_params: int
    weight_bytes: float  # per device
    kv_bytes_per_token: float  # per device
    kv_budget_bytes: float  # per device
    kv_tokens: int
    decode_ceiling_tok_s: float
    compute_bound_batch: float  # inf: KV reads keep decode memory-bound at any batch
    prefill_s_per_1k: float
    bandwidth: float
    flops: float
    quantization: str | None = None  # weight_bytes from the quantizer's own layout

    def lines(self) -> list[str]:
        batch = ("never: KV reads grow as fast as the math" if math.isinf(self.compute_bound_batch)
                 else f"from batch {self.compute_bound_batch:,.0f}")
        return [
            f"hardware        {self.hardware} x{self.tp}: {self.bandwidth / 1e9:,.1f} GB/s, "
            f"{self.flops / 1e12:,.2f} TFLOP/s for {self.dtype} weights, per device",
            f"parameters      {self.num_params / 1e9:,.3f} B",
            f"weights         {self.weight_bytes / 2**30:,.2f} GiB per device ("
            + (f"{self.quantization} linears, {self.dtype} elsewhere)" if self.quantization else f"{self.dtype})"),
            f"KV per token    {self.kv_bytes_per_token / 2**10:,.1f} KiB per device ({self.kv_dtype})",
            f"KV budget       {self.kv_budget_bytes / 2**30:,.2f} GiB per device = {self.kv_tokens:,} tokens",
            f"decode ceiling  {self.decode_ceiling_tok_s:,.1f} tok/s single-stream (context {self.context_len})",
            f"compute-bound   {batch} (decode, context {self.context_len})",
            f"prefill         {self.prefill_s_per_1k * 1e3:,.1f} ms per 1k-token prompt",
        ]


def normalize_dtype(name: str) -> str:
    name = str(name).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return name


def plan(shape: ModelShape, hw: Hardware, dtype: str | None = None, kv_dtype: str | None = None,
         tp: int = 1, context_len: int = 0, memory_fraction: float = 0.9,
         weight_bytes: float | None = None, quantization: str | None = None) -> Plan:
    """``weight_bytes`` (whole model) overrides parameters x bytes per weight: what a
    quantizer keeps (modserve.core.quantization.planned_weight_bytes)."""
    dtype = normalize_dtype(dtype or shape.dtype)
    kv_dtype = normalize_dtype(kv_dtype or ("bfloat16" if DTYPE_BYTES[dtype] < 2 else dtype))
    params = shape.num_params
    weights = (params * DTYPE_BYTES[dtype] if weight_bytes is None else weight_bytes) / tp
    kv_per_token = 2 * shape.num_layers * math.ceil(shape.num_kv_heads / tp) * shape.head_dim * DTYPE_BYTES[kv_dtype]
    budget = max(0.0, hw.memory * memory_fraction - weights)
    flops = hw.flops(dtype)
    flops_per_token = 2 * params / tp
    denominator = flops_per_token / flops - context_len * kv_per_token / hw.bandwidth
    batch = (weights / hw.bandwidth) / denominator if denominator > 0 else math.inf
    n = 1000
    prefill_flops = 2 * params * n + 2 * shape.num_layers * shape.num_heads * shape.head_dim * n * n
    return Plan(hw.name, tp, dtype, kv_dtype, context_len, params, weights, kv_per_token, budget,
                int(budget // kv_per_token), hw.bandwidth / (weights + context_len * kv_per_token),
                batch, prefill_flops / (tp * flops), hw.bandwidth, flops, quantization)


def measure_cpu(dtype: str = "float32", seconds: float = 0.5) -> Hardware:
    """This machine: available memory, copy bandwidth (read + write) of a 256 MiB buffer, and
    the matmul rate of 1024^2 GEMMs in ``dtype``, each the best of repeated tries."""
    import torch

    def best(fn, budget: float) -> float:
        fn()
        times, deadline = [], time.perf_counter() + budget
        while time.perf_counter() < deadline or len(times) < 3:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    src = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / best(lambda: dst.copy_(src), seconds)
    torch_dtype = getattr(torch, dtype) if dtype in ("float32", "bfloat16", "float16") else torch.float32
    a = torch.randn(1024, 1024).to(torch_dtype)
    rate = 2 * 1024**3 / best(lambda: torch.mm(a, a), seconds)
    with open("/proc/meminfo") as f:
        memory = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return Hardware("cpu", float(memory), bandwidth, rate, None, rate)


def hardware(name: str, dtype: str = "float32") -> Hardware:
    if name == "cpu":
        return measure_cpu(dtype)
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join([*HARDWARE, 'cpu'])}")
    return HARDWARE[name]
