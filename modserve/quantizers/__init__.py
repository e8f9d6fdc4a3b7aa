"""Built-in quantizers, registered like any plugin's (imports nothing heavy).

A checkpoint's ``quantization_config.quant_method`` selects the quantizer registered
under that name; ``quantization:`` in the engine config selects one explicitly.
"""

from __future__ import annotations

from modserve.api import Register, hookimpl


@hookimpl
def register_quantizers(register: Register) -> None:
    register("int8", "modserve.quantizers.int8:Int8", options="modserve.quantizers.int8:Int8Options",
             description="weight-only int8, per-output-channel symmetric scales, quantized at load")
    register("fp8", "modserve.quantizers.fp8:FP8Weights", options="modserve.quantizers.fp8:FP8Options",
             description="e4m3 weights, per-output-channel scales, quantized at load; fp8 matmul on "
             "GPUs that have it (compute capability 9.0+)")
    register("awq", "modserve.quantizers.awq:AWQ", options="modserve.quantizers.awq:AWQOptions",
             description="AutoAWQ checkpoints (4-bit GEMM packing, zero points, group scales)")
    register("gptq", "modserve.quantizers.gptq:GPTQ", options="modserve.quantizers.gptq:GPTQOptions",
             description="GPTQ checkpoints (4/8-bit, g_idx / desc_act, gptq and gptq_v2 formats)")
