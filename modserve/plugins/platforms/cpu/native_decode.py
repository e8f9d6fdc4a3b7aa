"""The CPU platform's native decode step: a step of decodes as one C++ call.

A decode step of one sequence reads ~160 MiB of weights in ~6 ms on two cores; around
those reads the compiled path spent 4-5 ms more: a compiled region per layer and for the
logits, each with dynamo's guard checks and inductor's wrapper, the attention op's Python,
and the Python that joins them. ``csrc/decode_step.cpp`` runs the whole decoder in one
call instead: the same linear ops (each quantizer names its own, ``Quantizer.native_op``)
and the same decode attention op (the backend names it, ``AttentionBackend.native_decode``),
called through the dispatcher, with the norms, RoPE, SiLU and residual adds in plain
loops between them (over rows on both threads once there are 8 or more). Prefills and
mixed steps keep the compiled forward. A decode step of 1, 8 and 24 sequences of the
88M reference model took 6.1, 14.8 and 36.8 ms against 8.7, 19.0 and 46.3 compiled; at
64, 89 against 90 ms (``scripts/decode_step_time.py``).

It runs where a model describes itself as a plain Llama decoder
(``CausalLM.decoder_layout``), in float32, and every piece names an op; the log says
which piece is missing otherwise. ``platform: {name: cpu, options: {native_decode: false}}``
turns it off.
"""

from __future__ import annotations

import functools
import logging

import torch

from modserve.api import AttentionBackend, AttentionMetadata, DecoderLayout, GraphSettings, StepForward, op_by_name
from modserve.plugins.platforms.cpu.kernels import CSRC, load_kernel

logger = logging.getLogger("modserve")

DECODE_STEP = CSRC / "decode_step.cpp"

class NativeLogits:
    """``compute_logits`` as the LM head's native op, which is all a
    :class:`~modserve.api.DecoderLayout` model's logits are: no compiled region to enter
    (~0.15 ms a step)."""

    def __init__(self, op: str, args: list[torch.Tensor | None]) -> None:
        self.op = op_by_name(op)
        self.args = args

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.op(hidden, *self.args)


class NativeDecodeStep:
    """A :data:`~modserve.api.StepForward`: steps of decodes only through ``decoder`` (a
    ``torch.classes.modserve_decode.DecodeStep``), every other step through ``forward``; the
    same hidden states ``[T, hidden]`` either way, to float error."""

    def __init__(self, forward: StepForward, decoder: torch.ScriptObject) -> None:
        self.forward = forward
        self.decoder = decoder

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.max_query_len == 1 and meta.num_tokens == meta.num_seqs:
            return self.decoder.forward(input_ids, meta.positions, meta.slot_mapping, meta.block_tables,
                                        meta.seq_lens)
        return self.forward(input_ids, meta)


def native_decode_step(forward: StepForward, backend: AttentionBackend,
                       settings: GraphSettings) -> StepForward | None:
    """A :class:`NativeDecodeStep` over ``forward``, or None where a piece has no native op
    (logged, naming it)."""
    layout = settings.model.decoder_layout() if settings.model is not None else None
    problem = _problem(layout, backend, settings)
    if problem is None:
        assert layout is not None
        problem = load_decode_step()
    if problem is not None:
        logger.info("native decode: off (%s)", problem)
        return None
    decoder = _build(layout, backend)
    decoder.set_kv_caches(list(settings.kv_caches))
    model = settings.model
    if (head := layout.lm_head.quantizer.native_op(layout.lm_head)) is not None:
        model.compute_logits = NativeLogits(*head)
    logger.info("native decode: steps of decodes run as one C++ call (%d layers; attention %s)",
                len(layout.layers), backend.native_decode())
    return NativeDecodeStep(forward, decoder)


def _problem(layout: DecoderLayout | None, backend: AttentionBackend, settings: GraphSettings) -> str | None:
    if layout is None:
        return f"{type(settings.model).__name__} describes no plain decoder layout"
    if layout.embedding.dtype != torch.float32:
        return f"it computes in float32, this model in {str(layout.embedding.dtype).removeprefix('torch.')}"
    if backend.native_decode() is None:
        return f"attention backend {settings.attention_backend} has no native decode op here"
    for i, layer in enumerate(layout.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            linear = getattr(layer, name)
            if linear.quantizer.native_op(linear) is None:
                return f"layer {i}'s {name} ({type(linear.quantizer).__name__}) has no native op"
    return None


def _build(layout: DecoderLayout, backend: AttentionBackend) -> torch.ScriptObject:
    decoder = torch.classes.modserve_decode.DecodeStep(
        layout.embedding.detach(), layout.final_norm.detach(), layout.cos, layout.sin, layout.num_heads,
        layout.num_kv_heads, layout.head_dim, layout.rms_norm_eps, backend.spec.scale, backend.native_decode())
    for layer in layout.layers:
        decoder.add_layer(layer.input_norm.detach(), layer.post_norm.detach())
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            op, args = linear.quantizer.native_op(linear)
            decoder.add_linear(op, [a if a is None else a.detach() for a in args])
    return decoder


@functools.cache
def load_decode_step() -> str | None:
    """Build or load ``torch.classes.modserve_decode.DecodeStep``; None once loaded, else why not."""
    return load_kernel("modserve_decode_step", str(DECODE_STEP))
