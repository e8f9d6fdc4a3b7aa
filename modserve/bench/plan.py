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

Tensor parallelism's price (``tp_comms``), per decode step at batch B:

- 2 all-reduces per decoder layer (after o_proj and down_proj, the row-parallel linears) of
  B x hidden x activation bytes, one more in the vocab-parallel embedding, and one all-gather
  of the logits (B x padded vocab x activation bytes, gathered): 2 L + 1 all-reduces
- step time = max(read time, math time) of one device's share + the collectives' time, where
  read time = (weights + B x context x KV per token) / bandwidth and math = 2 P B / (tp F);
  TP=N is worth it when that beats the same step at TP=1
- a collective's time comes from a measured curve (``modserve bench collectives --json``) or
  an interconnect preset: latency + bytes x busbw factor / busbw (NCCL-tests' busbw)

Pipeline parallelism (``pipeline``): layers split into pp stages; each stage boundary sends
the residual stream, hidden x activation bytes per token; with m micro-batches in flight a
simple (GPipe-like) schedule idles a fraction (pp - 1) / (m + pp - 1) of each device's time.

Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): a MoE layer holds E experts of
``moe_intermediate`` (and a shared expert, for Qwen2-MoE) and routes each token to k of them:

- total parameters count every expert; active parameters per token count k of them
- single-stream decode ceiling = bandwidth / (active weight bytes + context x KV bytes per
  token): a step of one token reads only the experts it is routed to
- a decode step of B tokens reads E (1 - (1 - k/E)^B) distinct experts per layer on average
  (uniform routing); every expert is hit from the batch where fewer than half an expert is
  expected idle: B > ln(0.5 / E) / ln(1 - k/E). From there a step reads all the weights
- the compute-bound batch takes the active FLOPs per token against all weights read

Datasheet figures are dense (no sparsity) tensor-core rates and HBM bandwidths of the SXM
parts, decimal units.
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
    # Mixture of experts (0: dense): experts per MoE layer, routed per token, each one's size,
    # the shared expert's size (0: none), how many of the layers are MoE layers.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = 0

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "ModelShape":
        heads = cfg["num_attention_heads"]
        dtype = normalize_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        model_type = cfg.get("model_type", "")
        return cls(
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))), dtype=dtype,
            **_moe_shape(cfg))

    @classmethod
    def load(cls, path: str | Path) -> "ModelShape":
        """From a checkpoint directory or its config.json."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no config.json at {path}")
        return cls.from_config(json.loads(file.read_text()))

    @property
    def params_per_layer(self) -> int:
        """Averaged over the layers (MoE and dense ones alike), every expert counted."""
        return self._params_per_layer(self.num_experts)

    @property
    def active_params_per_layer(self) -> int:
        """What one token reads: ``experts_per_token`` of a MoE layer's experts."""
        return self._params_per_layer(self.experts_per_token)

    def _params_per_layer(self, experts: int) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        dense_mlp = 3 * h * self.intermediate_size  # gate, up, down
        moe_mlp = (h * self.num_experts  # the router
                   + experts * 3 * h * self.moe_intermediate_size
                   + (3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0))
        moe = self.num_moe_layers
        mlps = (moe * moe_mlp + (self.num_layers - moe) * dense_mlp) // self.num_layers
        return attn + mlps + 2 * h  # two RMSNorms

    @property
    def num_params(self) -> int:
        return self._num_params(self.params_per_layer)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses (all of them for a dense model)."""
        return self._num_params(self.active_params_per_layer)

    def _num_params(self, per_layer: int) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size  # final norm

    def experts_hit(self, batch: int) -> float:
        """Distinct experts a step of ``batch`` tokens reads per MoE layer, on average, if each
        token picks its ``experts_per_token`` uniformly."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1 - (1 - k / e) ** batch) if e else 0.0

    @property
    def all_experts_batch(self) -> int:
        """The smallest batch at which fewer than half an expert per layer is expected idle."""
        e, k = self.num_experts, self.experts_per_token
        if not e:
            return 0
        if k >= e:
            return 1
        return math.floor(math.log(0.5 / e) / math.log(1 - k / e)) + 1


def _moe_shape(cfg: dict[str, Any]) -> dict[str, int]:
    """The MoE fields of :class:`ModelShape` from a Mixtral, Qwen2-MoE or Qwen3-MoE config."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not experts:
        return {}
    layers = cfg["num_hidden_layers"]
    if "num_local_experts" in cfg:  # Mixtral: every layer, intermediate_size is each expert's
        moe_layers, size = layers, cfg["intermediate_size"]
    else:  # Qwen2-MoE, Qwen3-MoE: every decoder_sparse_step-th layer not in mlp_only_layers
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        size = cfg["moe_intermediate_size"]
    return {"num_experts": experts, "experts_per_token": cfg["num_experts_per_tok"], "moe_intermediate_size": size,
            "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0,
            "num_moe_layers": moe_layers}


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
    # Mixture of experts: parameters a token uses, the weight bytes a single-stream step reads,
    # "E experts, top k", the batch from which every expert is hit. None / 0 for dense models.
    active_params: int | None = None
    active_weight_bytes: float | None = None
    experts: str | None = None
    all_experts_batch: int = 0

    def lines(self) -> list[str]:
        batch = ("never: KV reads grow as fast as the math" if math.isinf(self.compute_bound_batch)
                 else f"from batch {self.compute_bound_batch:,.0f}")
        moe = [] if self.experts is None else [
            f"experts         {self.experts}: {self.active_params / 1e9:,.3f} B active of "
            f"{self.num_params / 1e9:,.3f} B; a token reads {self.active_weight_bytes / 2**30:,.2f} GiB per device",
            f"every expert    hit from batch {self.all_experts_batch:,} (uniform routing; then a step reads "
            f"all the weights)"]
        return [
            f"hardware        {self.hardware} x{self.tp}: {self.bandwidth / 1e9:,.1f} GB/s, "
            f"{self.flops / 1e12:,.2f} TFLOP/s for {self.dtype} weights, per device",
            f"parameters      {self.num_params / 1e9:,.3f} B",
            *moe,
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
    quantizer keeps (modserve.runner.quantization.planned_weight_bytes)."""
    dtype = normalize_dtype(dtype or shape.dtype)
    kv_dtype = normalize_dtype(kv_dtype or ("bfloat16" if DTYPE_BYTES[dtype] < 2 else dtype))
    params, active = shape.num_params, shape.active_params
    weights = (params * DTYPE_BYTES[dtype] if weight_bytes is None else weight_bytes) / tp
    read = weights * active / params  # what a step of one token reads: its experts only
    kv_per_token = 2 * shape.num_layers * math.ceil(shape.num_kv_heads / tp) * shape.head_dim * DTYPE_BYTES[kv_dtype]
    budget = max(0.0, hw.memory * memory_fraction - weights)
    flops = hw.flops(dtype)
    flops_per_token = 2 * active / tp
    denominator = flops_per_token / flops - context_len * kv_per_token / hw.bandwidth
    batch = (weights / hw.bandwidth) / denominator if denominator > 0 else math.inf
    n = 1000
    prefill_flops = 2 * active * n + 2 * shape.num_layers * shape.num_heads * shape.head_dim * n * n
    moe = {} if not shape.num_experts else dict(
        active_params=active, active_weight_bytes=read, all_experts_batch=shape.all_experts_batch,
        experts=f"{shape.num_experts} experts, top {shape.experts_per_token}, in {shape.num_moe_layers} of "
                f"{shape.num_layers} layers" + (", a shared expert" if shape.shared_expert_intermediate_size else ""))
    return Plan(hw.name, tp, dtype, kv_dtype, context_len, params, weights, kv_per_token, budget,
                int(budget // kv_per_token), hw.bandwidth / (read + context_len * kv_per_token),
                batch, prefill_flops / (tp * flops), hw.bandwidth, flops, quantization, **moe)


def measure_cpu(dtype: str = "float32", seconds: float = 0.5) -> Hardware:
    """This machine: available memory, the rate of reading memory, and the matmul rate of
    1024^2 GEMMs in ``dtype``, each the best of repeated tries. The bandwidth is a float32
    sum over :func:`read_buffer` (beyond the last-level cache, in huge pages where the OS
    gives them, as the cpu platform's weights are): a decode step reads its weights and
    writes next to nothing; a copy, which also writes, runs slower than a read, and decodes
    read faster than a copy's ceiling (docs/benchmarks.md)."""
    import torch

    def best(fn, budget: float) -> float:
        fn()
        times, deadline = [], time.perf_counter() + budget
        while time.perf_counter() < deadline or len(times) < 3:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    buffer = read_buffer()
    bandwidth = buffer.nbytes / best(buffer.sum, seconds)
    del buffer
    torch_dtype = getattr(torch, dtype) if dtype in ("float32", "bfloat16", "float16") else torch.float32
    a = torch.randn(1024, 1024).to(torch_dtype)
    rate = 2 * 1024**3 / best(lambda: torch.mm(a, a), seconds)
    with open("/proc/meminfo") as f:
        memory = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return Hardware("cpu", float(memory), bandwidth, rate, None, rate)


READ_MIN_BYTES = 1 << 30


def read_buffer() -> "torch.Tensor":  # [n] float32, all ones
    """What :func:`measure_cpu` reads: twice the last-level cache, at least ``READ_MIN_BYTES``,
    so that a sum of it streams from memory, not from cache."""
    import torch

    nbytes = max(READ_MIN_BYTES, 2 * last_level_cache_bytes())
    return _huge_or_plain(nbytes).view(torch.float32).fill_(1.0)


def last_level_cache_bytes(cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of CPU 0's highest-level cache (sysfs), 0 where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes: dict[int, int] = {}
    for index in cpu.glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            nbytes = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
        except (OSError, ValueError):
            continue
        sizes[level] = max(sizes.get(level, 0), nbytes)
    return sizes[max(sizes)] if sizes else 0


def _huge_or_plain(nbytes: int) -> "torch.Tensor":  # [nbytes] uint8
    import torch

    from modserve.plugins.platforms.cpu.huge_pages import huge_page_buffer

    try:
        return huge_page_buffer(nbytes)
    except (OSError, AttributeError):  # no madvise here: ordinary pages
        return torch.empty(nbytes, dtype=torch.uint8)


def copy_buffers(nbytes: int) -> tuple["torch.Tensor", "torch.Tensor"]:  # 2 x [nbytes / 4] float32
    """A source of ones and a zeroed destination, for timing a copy (the scripts print one
    beside the read rate)."""
    import torch

    src, dst = (_huge_or_plain(nbytes).view(torch.float32) for _ in range(2))
    return src.fill_(1.0), dst.zero_()


def hardware(name: str, dtype: str = "float32") -> Hardware:
    if name == "cpu":
        return measure_cpu(dtype)
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join([*HARDWARE, 'cpu'])}")
    return HARDWARE[name]


# -- tensor and pipeline parallelism ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Interconnect:
    """A collective's time as latency + the bytes each rank's link carries / busbw (the
    alpha-beta model NCCL-tests' busbw is made for). ``source``: where the figures come from."""

    name: str
    latency: float  # s: a small message's all-reduce (alpha)
    busbw: float  # bytes/s: a large all-reduce's bus bandwidth
    source: str

    def time(self, op: str, nbytes: float, n: int) -> float:
        from modserve.bench.collectives import bus_factor

        return self.latency + nbytes * bus_factor(op, n) / self.busbw

    def describe(self) -> str:
        return (f"{self.name} preset: {self.latency * 1e6:g} us + bytes / {self.busbw / 1e9:g} GB/s busbw "
                f"({self.source})")


INTERCONNECTS = {
    # NVIDIA A100 datasheet: NVLink 3, 600 GB/s per GPU both directions = 300 GB/s each way;
    # nccl-tests on 8x A100 SXM reach a busbw of about 230-250 GB/s (the reference table of
    # docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests, as for NVLink 4 below).
    "nvlink3": Interconnect("nvlink3", 10e-6, 240e9, "A100 SXM NVLink 3: 300 GB/s each way, nccl-tests ~240"),
    # NVIDIA H100 datasheet: NVLink 4, 900 GB/s per GPU both directions = 450 GB/s each way;
    # nccl-tests on 8x H100 SXM reach a busbw of 450-480 GB/s (NVLink SHARP). Latency: a 1 KiB
    # NCCL all-reduce is ~3.5 us of kernel on 4x H800 NVLink without CUDA graphs
    # (NVIDIA/nccl#1984); 10 us adds an eager torch.distributed call's launch and sync (estimate).
    "nvlink4": Interconnect("nvlink4", 10e-6, 450e9, "H100/H200 SXM NVLink 4: 900 GB/s both ways "
                            "(NVIDIA spec) = 450 each way; latency estimated"),
    # NVIDIA B200 spec: NVLink 5, 1.8 TB/s per GPU both directions = 900 GB/s each way.
    "nvlink5": Interconnect("nvlink5", 10e-6, 900e9, "B200 NVLink 5: 1.8 TB/s both ways (NVIDIA spec) "
                            "= 900 each way; latency estimated"),
    # PCI-SIG: PCIe 4.0 x16 = 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s each way; ~25 GB/s in
    # practice. Latency: without peer-to-peer, NCCL stages through host memory (estimate).
    "pcie4": Interconnect("pcie4", 25e-6, 25e9, "PCIe 4.0 x16: 31.5 GB/s each way (PCI-SIG), "
                          "~25 practical; latency estimated"),
    # NVIDIA ConnectX-7: NDR InfiniBand, 400 Gb/s per port = 50 GB/s each way; one NIC per GPU is
    # the usual rail. Between nodes: prefill and decode instances apart (--disaggregate).
    "ib-ndr400": Interconnect("ib-ndr400", 10e-6, 50e9, "NDR InfiniBand 400 Gb/s per GPU (ConnectX-7) = 50 GB/s "
                              "each way; latency estimated"),
    # Measured 2026-12-02: modserve bench collectives --world-size 2 on the 2-core AMD EPYC dev box
    # (gloo over loopback, float32, 1 thread per rank, load average 4.4 from other jobs): medians
    # of 0.5-0.65 ms up to 64 KiB, 17 ms at 16 MiB (busbw ~1 GB/s), 0.5-0.8 GB/s from 1 to 8 MiB.
    "loopback-gloo": Interconnect("loopback-gloo", 600e-6, 0.8e9, "gloo over loopback, 2 ranks on a "
                                  "busy 2-core AMD EPYC, measured by modserve bench collectives"),
}
DEFAULT_INTERCONNECT = {"h100": "nvlink4", "h200": "nvlink4", "b200": "nvlink5", "a100-80g": "nvlink3",
                        "cpu": "loopback-gloo"}


@dataclass(frozen=True, slots=True)
class MeasuredCollectives:
    """Times from a ``modserve bench collectives --json`` file, interpolated by size."""

    name: str
    world_size: int
    points: dict[str, list[tuple[float, float]]]  # op -> [(bytes, median seconds)]
    device: str = "cpu"  # where it was measured: cpu (gloo) or cuda (NCCL)

    @classmethod
    def load(cls, path: str | Path) -> "MeasuredCollectives":
        from modserve.bench.collectives import load_curve

        data = load_curve(path)
        m = data["meta"]
        points: dict[str, list[tuple[float, float]]] = {}
        for r in data["results"]:
            points.setdefault(r["op"], []).append((float(r["bytes"]), r["median_us"] * 1e-6))
        return cls(f"measured: {path} ({m['backend']} x{m['world_size']}, {m['dtype']}, {m['machine']}, "
                   f"{m['date'][:10]})", int(m["world_size"]), points, m.get("device", "cpu"))

    def time(self, op: str, nbytes: float, n: int) -> float:
        from modserve.bench.collectives import interpolate

        # NOTE: no all-gather measured: an all-reduce of the same bytes, which moves twice as much
        return interpolate(self.points.get(op) or self.points["all_reduce"], nbytes)

    def describe(self) -> str:
        return self.name


def interconnect(name: str | None, hardware_name: str,
                 allreduce_json: str | None = None) -> Interconnect | MeasuredCollectives:
    """The collectives' cost model: ``allreduce_json``'s measured curve, else the ``name``d
    preset, else the hardware's usual link."""
    if allreduce_json:
        return MeasuredCollectives.load(allreduce_json)
    name = name or DEFAULT_INTERCONNECT.get(hardware_name, "pcie4")
    if name not in INTERCONNECTS:
        raise ValueError(f"unknown interconnect {name!r}; known: {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[name]


def activation_dtype(weight_dtype: str) -> str:
    """What the hidden states are: the weights' dtype, at least 16-bit (fp8/int weights dequantize)."""
    return "bfloat16" if DTYPE_BYTES[weight_dtype] < 2 else weight_dtype


def padded_vocab(vocab_size: int, tp: int, multiple: int = 64) -> int:
    """As modserve.runner.linear.padded_vocab: every rank an equal multiple of 64 rows (vLLM's rule)."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def step_time(p: Plan, batch: int) -> float:
    """One decode step of ``batch`` sequences on one device of the plan: the weights' and the
    context's KV read, or the math, whichever takes longer."""
    read = (p.weight_bytes + batch * p.context_len * p.kv_bytes_per_token) / p.bandwidth
    return max(read, 2 * p.num_params / p.tp * batch / p.flops)


@dataclass(frozen=True, slots=True)
class TPComms:
    tp: int
    batch: int
    context_len: int
    hidden_size: int
    act_dtype: str
    interconnect: str
    allreduce_bytes_per_token_layer: float  # 2 all-reduces x hidden x activation bytes
    allreduces_per_step: int  # 2 per layer + the embedding's
    allreduce_bytes: float  # one all-reduce at batch B: B x hidden x activation bytes
    allreduce_s: float  # one all-reduce of that size
    allgather_bytes: float  # the logits, gathered: B x padded vocab x activation bytes
    allgather_s: float
    step_s_tp1: float  # the decode step at TP=1
    step_s_compute: float  # at TP=N, reads and math only
    fits_tp1: bool  # the weights and the batch's KV fit one device
    note: str = ""

    @property
    def comms_s(self) -> float:
        return self.allreduces_per_step * self.allreduce_s + self.allgather_s

    @property
    def step_s(self) -> float:
        return self.step_s_compute + self.comms_s

    @property
    def worth_it(self) -> bool:
        return self.step_s < self.step_s_tp1

    def verdict(self) -> str:
        saved = self.step_s_tp1 - self.step_s_compute
        figures = f"all-reduce + all-gather {self.comms_s * 1e6:,.1f} us per step vs {saved * 1e6:,.1f} us saved"
        if not self.fits_tp1:
            return f"needed: TP=1 does not fit the weights and the batch's KV; {figures}"
        return f"TP={self.tp} {'worth it' if self.worth_it else 'not worth it'}: {figures}"

    def lines(self) -> list[str]:
        b, kib, us = self.batch, 2**10, 1e6
        out = [
            f"TP comms        2 all-reduces per layer x hidden {self.hidden_size} x {DTYPE_BYTES[self.act_dtype]:g} B "
            f"({self.act_dtype}) = {self.allreduce_bytes_per_token_layer / kib:,.1f} KiB per token per layer",
            f"per step        batch {b}: {self.allreduces_per_step} all-reduces (2 per layer + embedding) of "
            f"{self.allreduce_bytes / kib:,.1f} KiB + 1 all-gather of {self.allgather_bytes / kib:,.1f} KiB (logits)",
            f"interconnect    {self.interconnect}",
            f"collectives     all-reduce {self.allreduce_s * us:,.1f} us, all-gather {self.allgather_s * us:,.1f} us: "
            f"{self.allreduces_per_step} x {self.allreduce_s * us:,.1f} + {self.allgather_s * us:,.1f} = "
            f"{self.comms_s * us:,.1f} us per step",
            f"decode step     TP=1 {self.step_s_tp1 * us:,.1f} us; TP={self.tp} {self.step_s_compute * us:,.1f} us "
            f"reads/math + {self.comms_s * us:,.1f} us collectives = {self.step_s * us:,.1f} us "
            f"(batch {b}, context {self.context_len})",
            f"verdict         {self.verdict()}",
        ]
        return out + ([f"note            {self.note}"] if self.note else [])


def tp_comms(shape: ModelShape, p1: Plan, pn: Plan, link: Interconnect | MeasuredCollectives, batch: int = 1,
             note: str = "") -> TPComms:
    """The collectives of TP=``pn.tp`` and what they cost against the reads they save over ``p1`` (TP=1)."""
    act = activation_dtype(pn.dtype)
    a = DTYPE_BYTES[act]
    allreduce = batch * shape.hidden_size * a
    gather = batch * padded_vocab(shape.vocab_size, pn.tp) * a
    fits = p1.kv_tokens >= batch * max(1, p1.context_len)
    return TPComms(pn.tp, batch, pn.context_len, shape.hidden_size, act, link.describe(), 2 * shape.hidden_size * a,
                   2 * shape.num_layers + 1, allreduce, link.time("all_reduce", allreduce, pn.tp), gather,
                   link.time("all_gather", gather, pn.tp), step_time(p1, batch), step_time(pn, batch), fits, note)


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    pp: int
    micro_batches: int
    batch: int
    layers_per_stage: int  # the largest stage's
    num_layers: int
    stage_weight_bytes: float  # per device on the largest stage: its layers + the vocabulary matrix
    act_dtype: str
    send_bytes_per_token: float  # per stage boundary: hidden x activation bytes
    boundaries: int  # pp - 1

    @property
    def bubble(self) -> float:
        return (self.pp - 1) / (self.micro_batches + self.pp - 1)

    def lines(self) -> list[str]:
        kib = 2**10
        return [
            f"pipeline        PP={self.pp}: {self.layers_per_stage} of {self.num_layers} layers per stage, "
            f"{self.stage_weight_bytes / 2**30:,.2f} GiB of weights per device on the largest stage",
            f"PP sends        hidden x {DTYPE_BYTES[self.act_dtype]:g} B ({self.act_dtype}) = "
            f"{self.send_bytes_per_token / kib:,.1f} KiB per token across each of {self.boundaries} stage "
            f"boundaries; {self.batch * self.send_bytes_per_token / kib:,.1f} KiB per boundary per decode step "
            f"at batch {self.batch}",
            f"bubble          {self.bubble:.1%} idle with {self.micro_batches} micro-batches in flight: "
            f"(pp - 1) / (micro-batches + pp - 1) = {self.pp - 1} / {self.micro_batches + self.pp - 1}",
        ]


def pipeline(shape: ModelShape, p: Plan, pp: int, micro_batches: int | None = None, batch: int = 1) -> PipelinePlan:
    """Layers split into ``pp`` stages (the first stages one more when uneven); the first stage
    also holds the embedding, the last the LM head: the largest stage has one vocabulary matrix.
    ``micro_batches`` defaults to ``pp``, the fewest that keep every stage busy in the steady state."""
    if pp < 1 or pp > shape.num_layers:
        raise ValueError(f"pipeline-parallel size {pp} must be 1..{shape.num_layers} (the layers)")
    layers = -(-shape.num_layers // pp)
    vocab = shape.num_params - shape.num_layers * shape.params_per_layer  # embeddings, LM head, final norm
    if pp > 1:
        vocab = shape.vocab_size * shape.hidden_size  # the first stage's embedding or the last's LM head
    stage_params = layers * shape.params_per_layer + vocab
    act = activation_dtype(p.dtype)
    return PipelinePlan(pp, micro_batches or pp, batch, layers, shape.num_layers,
                        p.weight_bytes * stage_params / p.num_params, act, shape.hidden_size * DTYPE_BYTES[act], pp - 1)


# -- disaggregated prefill and decode -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Disaggregation:
    """A prefill pool and a decode pool of instances (each ``tp`` devices of the plan) for a
    workload of ``input_len``-token prompts and ``output_len``-token answers at ``request_rate``.

    - prefill s per request = max(FLOPs / (tp F), weights / BW), FLOPs = 2 P_active N + 2 L H d N^2
      (the causal attention's QK^T and PV): long prompts are compute-bound, and a prefill instance
      runs one prompt's math at a time at full rate, so batching prompts buys it nothing
    - decode step at batch B = max((weights + B c KV per token) / BW, 2 P_active B / (tp F)), c the
      mean context over the answer, N + M / 2; the step gives each of the B sequences one token,
      so a request costs M x step / B decode instance-seconds
    - instances = request rate x instance-seconds per request, each pool rounded up
    - KV moved per request = N x KV bytes per token, each device its share over its own link:
      latency + N x KV per token per device / the link's bandwidth
    """

    input_len: int
    output_len: int
    batch: int
    request_rate: float | None
    tp: int
    prefill_flops: float  # per request
    prefill_s: float  # per request, one instance
    decode_context: float  # mean tokens of KV a decode step reads per sequence
    decode_step_s: float  # one step at the batch: one token for each of its sequences
    decode_s: float  # decode instance-seconds per request: output_len x step / batch
    kv_bytes: float  # per request, all devices: input_len x KV per token per device x tp
    link: str
    transfer_s: float  # per request
    batch_fits: bool  # batch x (input_len + output_len) tokens of KV fit a decode instance
    max_batch: int  # the largest that does

    @property
    def ratio(self) -> float:
        """Decode instances per prefill instance, at any rate."""
        return self.decode_s / self.prefill_s

    @property
    def prefill_instances(self) -> int | None:
        return None if self.request_rate is None else max(1, math.ceil(self.request_rate * self.prefill_s - 1e-9))

    @property
    def decode_instances(self) -> int | None:
        return None if self.request_rate is None else max(1, math.ceil(self.request_rate * self.decode_s - 1e-9))

    @property
    def ttft_s(self) -> float:
        return self.prefill_s + self.transfer_s + self.decode_step_s

    def sizing(self) -> str:
        if self.request_rate is None:
            return f"1 prefill : {self.ratio:,.2f} decode (instance-seconds per request; --request-rate sizes pools)"
        return (f"{self.prefill_instances} prefill : {self.decode_instances} decode at {self.request_rate:g} "
                f"req/s ({self.request_rate * self.prefill_s:,.2f} and {self.request_rate * self.decode_s:,.2f} "
                f"busy; 1 : {self.ratio:,.2f} exactly), {self.tp} device(s) each")

    def lines(self) -> list[str]:
        ms = 1e3
        fits = "" if self.batch_fits else f" (does not fit: at most batch {self.max_batch:,} of this KV)" \
            if self.max_batch else " (does not fit: the weights leave no room for this KV; raise --tp)"
        return [
            f"disaggregated   {self.input_len:,} prompt + {self.output_len:,} output tokens per request",
            f"prefill pool    {self.prefill_s * ms:,.1f} ms per request ({self.prefill_flops / 1e12:,.2f} TFLOP)"
            f" = {self.prefill_s:,.4f} instance-s",
            f"decode pool     {self.decode_step_s * ms:,.2f} ms per token at batch {self.batch}{fits}, context "
            f"{self.decode_context:,.0f}: {self.output_len} x {self.decode_step_s * ms:,.2f} / {self.batch} = "
            f"{self.decode_s:,.4f} instance-s per request",
            f"pools           {self.sizing()}",
            f"KV transfer     {self.kv_bytes / 2**20:,.1f} MiB per request, {self.transfer_s * ms:,.2f} ms over "
            f"{self.link}",
            f"first token     {self.ttft_s * ms:,.1f} ms unloaded: prefill + KV transfer + one decode step",
        ]


def disaggregation(shape: ModelShape, p: Plan, link: Interconnect | MeasuredCollectives, input_len: int,
                   output_len: int, batch: int = 1, request_rate: float | None = None) -> Disaggregation:
    """Size the pools of :class:`Disaggregation` on the devices of ``p`` (its dtype, KV dtype, tp)."""
    if input_len < 1 or output_len < 1 or batch < 1:
        raise ValueError(f"--input-len ({input_len}), --output-len ({output_len}) and --batch-size ({batch}) "
                         "must be at least 1")
    if request_rate is not None and request_rate <= 0:
        raise ValueError(f"--request-rate {request_rate} must be above 0")
    active = shape.active_params
    n, kv = input_len, p.kv_bytes_per_token
    flops = 2 * active * n + 2 * shape.num_layers * shape.num_heads * shape.head_dim * n * n
    read_weights = p.weight_bytes / p.bandwidth
    prefill_s = max(flops / (p.tp * p.flops), read_weights)
    context = input_len + output_len / 2
    step = max((p.weight_bytes + batch * context * kv) / p.bandwidth, 2 * active * batch / (p.tp * p.flops))
    per_device = n * kv
    # A point-to-point send: a preset's busbw is its link's each-way rate; a measured curve is
    # read as an all-reduce of those bytes, which moves more than one send (an upper bound).
    transfer = link.latency + per_device / link.busbw if isinstance(link, Interconnect) \
        else link.time("all_reduce", per_device, 2)
    max_batch = p.kv_tokens // (input_len + output_len)
    return Disaggregation(input_len, output_len, batch, request_rate, p.tp, flops, prefill_s, context, step,
                          output_len * step / batch, per_device * p.tp, link.describe(), transfer,
                          batch <= max_batch, max_batch)
