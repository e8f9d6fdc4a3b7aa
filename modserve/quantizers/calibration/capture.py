"""Calibration data and each decoder layer's linear inputs, captured from the transformers model.

Layers are quantized in order; each layer's inputs are captured with every earlier layer
already quantized (their weights replaced by the dequantized ones), so a layer is fitted to
the activations it will see, as AWQ and GPTQ both do.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class CalibrationError(ValueError):
    """Bad calibration input: the message says what."""


def calibration_windows(tokenizer: Any, path: Path, num_samples: int, seq_len: int) -> torch.Tensor:
    """``[num_samples, seq_len]`` token ids: consecutive windows of the text, spread evenly over it."""
    if not path.is_file():
        raise CalibrationError(f"calibration text {path} does not exist")
    ids = torch.tensor(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"], dtype=torch.long)
    windows = ids.numel() // seq_len
    if windows == 0:
        raise CalibrationError(f"calibration text {path} has {ids.numel()} tokens, fewer than one window of "
                               f"--seq-len {seq_len}")
    pick = torch.linspace(0, windows - 1, min(num_samples, windows)).round().long().unique()
    return ids[: windows * seq_len].view(windows, seq_len)[pick]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(isinstance(layer.get_submodule(n), nn.Linear) for layer in layers
                                 for n in LLAMA_LINEARS):
        raise CalibrationError(f"{type(model).__name__} is not a Llama-style decoder (model.layers[i] with "
                               f"{', '.join(LLAMA_LINEARS)})")
    return layers


class Inputs:
    """Per linear of one layer: ``H = X^T X`` over every calibration token (GPTQ), the mean
    ``|x|`` per input channel and a row sample of ``X`` (AWQ)."""

    def __init__(self, sample_rows: int) -> None:
        self.sample_rows = sample_rows
        self.hessian: dict[str, torch.Tensor] = {}  # [K, K] float64 sums
        self.abs_sum: dict[str, torch.Tensor] = {}  # [K]
        self.rows: dict[str, int] = defaultdict(int)
        self.samples: dict[str, list[torch.Tensor]] = defaultdict(list)

    def add(self, name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()  # [T, K]
        if name not in self.hessian:
            self.hessian[name] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
            self.abs_sum[name] = torch.zeros(x.shape[1], dtype=torch.float64)
        self.hessian[name] += x.T @ x
        self.abs_sum[name] += x.abs().sum(0)
        self.rows[name] += x.shape[0]
        step = max(1, x.shape[0] // max(1, self.sample_rows // 8))  # a few rows of each batch
        self.samples[name].append(x[::step].float())

    def sample(self, name: str) -> torch.Tensor:  # [<= sample_rows, K]
        return torch.cat(self.samples[name])[: self.sample_rows]

    def mean_abs(self, name: str) -> torch.Tensor:  # [K]
        return (self.abs_sum[name] / self.rows[name]).float()


@torch.no_grad()
def layer_inputs(model: nn.Module, windows: torch.Tensor, index: int, batch: int = 8,
                 sample_rows: int = 4096) -> Inputs:
    """Run the model over the windows and record layer ``index``'s linear inputs (its own
    outputs are not needed: the forward stops being useful after it, but the model is small)."""
    layer = decoder_layers(model)[index]
    inputs = Inputs(sample_rows)
    hooks = [layer.get_submodule(name).register_forward_pre_hook(
        lambda _m, args, name=name: inputs.add(name, args[0])) for name in LLAMA_LINEARS]
    try:
        for chunk in windows.split(batch):
            model(input_ids=chunk, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return inputs


def linears(model: nn.Module, index: int) -> Iterator[tuple[str, nn.Linear]]:
    layer = decoder_layers(model)[index]
    for name in LLAMA_LINEARS:
        yield name, layer.get_submodule(name)
