"""Calibrated 4/8-bit quantization of a float checkpoint: ``modserve quantize``.

AWQ (activation-aware scale and clip search) and GPTQ (Hessian-based rounding) on
calibration text, layer by layer; the result is an AutoAWQ / GPTQ checkpoint that the
``awq`` and ``gptq`` quantizer plugins load like any other. This is a tool, not part of the
engine: it runs the transformers model, never modserve's.
"""
