"""``modserve quantize``'s work: a float checkpoint in, an AWQ or GPTQ checkpoint out, layer by layer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from modserve.quantizers.calibration.awq_search import fake_quantize, search_clip, search_scale
from modserve.quantizers.calibration.capture import (
    LLAMA_LINEARS, CalibrationError, Inputs, calibration_windows, decoder_layers, layer_inputs, linears,
)
from modserve.quantizers.calibration.formats import (
    awq_quantize, awq_tensors, gptq_tensors, quantization_config, write_checkpoint,
)
from modserve.quantizers.calibration.gptq_rounding import gptq_quantize_weight, gptq_round_to_nearest

# AWQ's groups: (the op whose output channels absorb 1 / s, the linears that read its output)
AWQ_GROUPS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
              ("self_attn.v_proj", ("self_attn.o_proj",)),
              ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
              ("mlp.up_proj", ("mlp.down_proj",)))
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


@dataclass(slots=True)
class Settings:
    method: str  # awq | gptq
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    num_samples: int = 128
    seq_len: int = 512
    damp_percent: float = 0.01
    clip: bool = True


@dataclass(slots=True)
class Report:
    """Per linear (``layers.i.<name>``): relative output error ``|X (W - Q)^T| / |X W^T|`` on the
    calibration inputs, calibrated and round-to-nearest."""
    calibrated: dict[str, float] = field(default_factory=dict)
    rtn: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    model: nn.Module | None = None  # the transformers model with the written weights, dequantized


def relative_error(w: torch.Tensor, q: torch.Tensor, hessian: torch.Tensor) -> float:
    """``|X (w - q)^T| / |X w^T|`` from ``H = X^T X``: ``tr(D H D^T) / tr(W H W^T)``."""
    d, w = (w - q).double(), w.double()
    return float(((d @ hessian) * d).sum() / ((w @ hessian) * w).sum()) ** 0.5


def _awq_layer(layer: nn.Module, inputs: Inputs, s: Settings) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Scale, clip and round one decoder layer in place: its linears' (q, zeros, scales), and per
    linear ``(in_scale [K], out_scale [N])``: its weight became ``W diag(in) / out[:, None]`` before
    rounding (its inputs were divided by ``in``; ``out`` is the next group's scale it absorbed)."""
    g = s.group_size
    scaled_inputs: dict[str, torch.Tensor] = {}
    input_scales: dict[str, torch.Tensor] = {}
    output_scales: dict[str, torch.Tensor] = {}
    for prev_name, names in AWQ_GROUPS:
        prev, mods = layer.get_submodule(prev_name), [layer.get_submodule(n) for n in names]
        if isinstance(prev, nn.Linear) and prev.out_features != mods[0].in_features:
            for n, m in zip(names, mods):  # grouped-query attention: v's rows are not o's inputs
                scaled_inputs[n], input_scales[n] = inputs.sample(n), torch.ones(m.in_features)
            continue
        x = inputs.sample(names[0])
        scale, _ = search_scale([m.weight.data for m in mods], x, inputs.mean_abs(names[0]), g)
        if isinstance(prev, nn.Linear):
            prev.weight.data /= scale[:, None]  # its output channels are the group's inputs
            output_scales[prev_name] = scale
        else:
            prev.weight.data /= scale  # an RMSNorm's weight
        for n, m in zip(names, mods):
            m.weight.data *= scale
            scaled_inputs[n], input_scales[n] = x / scale, scale
    out = {}
    for name, linear in linears_of(layer):
        w = linear.weight.data
        if s.clip and name not in NO_CLIP:
            w = search_clip(w, scaled_inputs[name], g)
        out[name] = awq_quantize(w, g)
        linear.weight.data = fake_quantize(w, g)
    return out, {n: (input_scales[n], output_scales.get(n, torch.ones(m.out_features))) for n, m in linears_of(layer)}


def linears_of(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, layer.get_submodule(n)) for n in LLAMA_LINEARS]


def check_settings(src: Path, s: Settings) -> None:
    """What can be refused before a model loads."""
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise CalibrationError(f"{src} is already quantized "
                               f"({config['quantization_config'].get('quant_method')}); give a float checkpoint")
    if s.method == "awq" and s.bits != 4:
        raise CalibrationError("awq writes 4-bit checkpoints only (AutoAWQ's GEMM format)")
    if s.bits not in (4, 8):
        raise CalibrationError(f"--bits {s.bits}: gptq writes 4 or 8 bits")


def check_model(model: nn.Module, s: Settings) -> None:
    for i in range(len(decoder_layers(model))):
        for name, linear in linears(model, i):
            if s.group_size != -1 and linear.in_features % s.group_size:
                raise CalibrationError(f"--group-size {s.group_size} does not divide layers.{i}.{name}'s "
                                       f"{linear.in_features} input features")
            if linear.bias is not None:
                raise CalibrationError(f"layers.{i}.{name} has a bias; modserve quantize handles bias-free "
                                       "Llama-style linears")


def quantize_checkpoint(src: str | Path, out: str | Path, text: str | Path, s: Settings,
                        progress: bool = True) -> Report:
    """Write ``out``: ``src`` with every decoder linear quantized by ``s.method`` on ``text``."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = Path(src), Path(out)
    check_settings(src, s)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    check_model(model, s)
    windows = calibration_windows(AutoTokenizer.from_pretrained(src), Path(text), s.num_samples, s.seq_len)
    report = Report(tokens=windows.numel())
    tensors: dict[str, torch.Tensor] = {}
    layers = decoder_layers(model)
    for i in tqdm(range(len(layers)), desc=f"{s.method} layers", disable=not progress):
        inputs = layer_inputs(model, windows, i)
        prefix = f"model.layers.{i}"
        originals = {n: m.weight.data.clone() for n, m in linears(model, i)}
        if s.method == "awq":
            norms = {n: layers[i].get_submodule(n).weight.data for n in ("input_layernorm",
                                                                          "post_attention_layernorm")}
            packed, folds = _awq_layer(layers[i], inputs, s)
            for name, (q, zeros, scales) in packed.items():
                tensors.update(awq_tensors(f"{prefix}.{name}", q, zeros, scales))
            for n, w in norms.items():
                tensors[f"{prefix}.{n}.weight"] = w.clone()
        for name, linear in linears(model, i):
            h, w0 = inputs.hessian[name], originals[name]
            if s.method == "gptq":
                result = gptq_quantize_weight(w0, h, s.bits, s.group_size, s.damp_percent, s.desc_act)
                tensors.update(gptq_tensors(f"{prefix}.{name}", result.q, result.zeros, result.scales,
                                            result.g_idx, s.bits))
                linear.weight.data = result.dequantized()
                effective = linear.weight.data
                rtn = gptq_round_to_nearest(w0, s.bits, s.group_size).dequantized()
            else:  # in the float model's terms: Q(W diag(in) / out) diag(1 / in) * out
                in_scale, out_scale = folds[name]
                effective = linear.weight.data / in_scale * out_scale[:, None]
                rtn = fake_quantize(w0, s.group_size)
            report.calibrated[f"layers.{i}.{name}"] = relative_error(w0, effective, h)
            report.rtn[f"layers.{i}.{name}"] = relative_error(w0, rtn, h)
    write_checkpoint(src, out, tensors, quantization_config(s.method, s.bits, s.group_size, s.desc_act,
                                                            damp_percent=s.damp_percent))
    report.model = model
    return report

