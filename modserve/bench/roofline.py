"""How far a measured run is from the hardware's limits (the roofline seed's two ceilings).

- decode, single stream: every step reads the weights once (plus the context's KV), so
  tok/s x bytes per token / bandwidth is the fraction of the memory roofline achieved;
- prefill and batched work: every token costs 2 FLOPs per parameter it multiplies plus its
  attention scores, so FLOPs / time / peak FLOP/s is the fraction of the compute roofline.

The FLOP count per token of position ``p`` (0-based) is
``2 x (layers x params per layer + vocab x hidden)`` (the embedding lookup multiplies nothing;
the LM head does) plus ``4 x layers x query dims x (p + 1)`` (scores and the weighted sum
over the ``p + 1`` positions it attends to). A MoE layer counts the experts a token uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from modserve.bench.plan import Hardware, ModelShape


def linear_flops_per_token(shape: ModelShape) -> int:
    """2 FLOPs per weight a token multiplies: its layers (a MoE layer's active experts) and the LM head."""
    return 2 * (shape.num_layers * shape.active_params_per_layer + shape.vocab_size * shape.hidden_size)


def attention_flops(shape: ModelShape, start: int, end: int) -> int:
    """Score and weighted-sum FLOPs of positions ``start .. end - 1``, each attending to every
    position up to itself: ``4 x layers x q dims x sum(p + 1)``."""
    q_dims = shape.num_heads * shape.head_dim
    positions = (end * (end + 1) - start * (start + 1)) // 2  # sum of (p + 1) for p in [start, end)
    return 4 * shape.num_layers * q_dims * positions


def request_flops(shape: ModelShape, prompt_len: int, output_len: int) -> int:
    """A request's forward FLOPs: its prompt, then each output token but the last (which is
    sampled, never fed back)."""
    tokens = prompt_len + max(0, output_len - 1)
    return linear_flops_per_token(shape) * tokens + attention_flops(shape, 0, tokens)


@dataclass(frozen=True, slots=True)
class ComputeFraction:
    flops: float  # the run's forward FLOPs
    achieved: float  # FLOP/s
    peak: float  # FLOP/s of the hardware in the compute dtype

    @property
    def fraction(self) -> float:
        return self.achieved / self.peak

    def line(self, hardware: str, what: str) -> str:
        return (f"{what}: {self.achieved / 1e12:.3f} TFLOP/s = {self.fraction:.0%} of the {hardware} compute "
                f"ceiling of {self.peak / 1e12:.3f} TFLOP/s ({self.flops / 1e9:,.1f} GFLOP)")


def compute_fraction(shape: ModelShape, hw: Hardware, dtype: str, lengths: Sequence[tuple[int, int]],
                     seconds: float) -> ComputeFraction:
    """The fraction of ``hw``'s compute ceiling a run of requests (prompt, output lengths) took
    ``seconds`` for achieved."""
    flops = float(sum(request_flops(shape, p, o) for p, o in lengths))
    return ComputeFraction(flops, flops / seconds, hw.flops(dtype))
