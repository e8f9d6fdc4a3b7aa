"""What this CPU can do, read once from ``/proc/cpuinfo``, and the linear route it picks.

Cloud x86 fleets are mostly Intel Sapphire/Emerald/Granite Rapids (AMX tiles: bf16 and
int8 matrix units) and AMD Zen 4/5 (AVX512-BF16 dot products, no AMX), with older AVX2
machines beside them. Which way a float linear reads a bfloat16 checkpoint's weights is
decided here once, from the flags, and logged at start-up; ``bench`` prints the same
line, so every figure names the machine and the route it measured.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

# Flags that change a kernel's route, in the order the log lists them.
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")

# Routes a float linear over a bfloat16 checkpoint can take (``platform.options.bf16_gemm``).
#   bf16_gemm: weights kept in bf16 only; every linear rounds its input to bf16 and runs
#              oneDNN's bf16 GEMM (AMX tiles where present), float32 out.
#   few_rows:  float32 weights for prefill and batches; up to 16 rows read a bf16 copy in
#              the C++ kernel (float32 input, exact products).
ROUTES = ("bf16_gemm", "few_rows")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    model: str  # /proc/cpuinfo "model name"
    flags: frozenset[str]  # the members of FLAGS this CPU reports

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def describe(self) -> str:
        """``"Intel(R) Xeon(R) Processor (avx2 avx512f ... amx_bf16)"``, what a figure names."""
        return f"{self.model} ({' '.join(f for f in FLAGS if f in self.flags) or 'no vector extensions we use'})"

    def default_route(self) -> str:
        """The route ``bf16_gemm: auto`` takes: oneDNN's bf16 GEMM on AMX tiles, where one
        streams weights faster than our few-rows kernel at every row count (benchmarks.md,
        CPU routes); the few-rows kernel elsewhere, the route measured on AVX512-BF16 and
        AVX2 machines, and on AVX-512 ones without bf16 instructions, where oneDNN's bf16
        GEMM converts in software and is slower than the kernel and the float32 GEMM alike."""
        return "bf16_gemm" if self.has("amx_bf16") else "few_rows"

    def few_rows_floats(self) -> int:
        """The vector width the few-rows kernel and the float32 panel GEMM compute in: 16
        floats on CPUs with AVX-512F but no AVX512-BF16 (Intel Xeons up to Ice Lake; on an Ice
        Lake one they read weights and multiply faster than the 8-float loops: benchmarks.md,
        CPU routes); 8 elsewhere, the loops measured on Zen 4 and AVX2 machines."""
        return 16 if self.has("avx512f") and not self.has("avx512_bf16") else 8


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's model name and flags from ``/proc/cpuinfo``'s text."""
    model, flags = "unknown CPU", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return CpuFeatures(model, frozenset(f for f in FLAGS if f in flags))


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's :class:`CpuFeatures`; ``MODSERVE_CPU_FLAGS`` (a space-separated
    subset of :data:`FLAGS`) replaces the flags, so a test can take another CPU's route."""
    try:
        found = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        found = CpuFeatures("unknown CPU", frozenset())
    forced = os.environ.get("MODSERVE_CPU_FLAGS")
    if forced is not None:
        unknown = set(forced.split()) - set(FLAGS)
        if unknown:
            raise ValueError(f"MODSERVE_CPU_FLAGS: unknown {sorted(unknown)}; known: {' '.join(FLAGS)}")
        found = CpuFeatures(found.model, frozenset(forced.split()))
    return found
