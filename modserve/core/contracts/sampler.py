"""The sampler's contract (config key ``sampler``): logits and the requests' settings in,
one token per row (and the logprobs asked for) out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from modserve.core.contracts.logits_processor import LogitsProcessor


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device. Samplers
    only read them: while a step's sequences stay the same, the runner passes the same
    tensors again."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] int64; <= 0 = off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    repetition_penalty: torch.Tensor  # [B]
    presence_penalty: torch.Tensor  # [B]
    frequency_penalty: torch.Tensor  # [B]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    generators: dict[int, torch.Generator]  # row -> seeded generator
    prompt_token_ids: torch.Tensor | None  # [B, P] padded with vocab_size, only with penalties
    output_token_ids: torch.Tensor | None  # [B, O] padded with vocab_size, only with penalties
    banned_token_ids: list[tuple[int, list[int]]]  # (row, ids) never to sample this step (min_tokens, bad_words)
    max_num_logprobs: int  # -1 when no row wants logprobs
    # [B, ceil(V / 32)] int32: bit t % 32 of word t // 32 set = token t may be sampled (grammar, allowed_token_ids,
    # one-token bad_words). Rows without them are all ones; None when no row has them.
    allowed_token_bitmask: torch.Tensor | None = None
    # logits[rows, ids] += biases, each [N] (int64, int64, float32), one per (row, token); None when no row has one
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The engine's logits processors (config logits_processors), their state already updated for these rows,
    # split by is_argmax_invariant(). vLLM's places: ``logits_processors`` after logit_bias and before
    # penalties, for every row (greedy ones too); ``argmax_invariant_processors`` after temperature and
    # before top-k/top-p, skipped when every row is greedy. Empty without processors.
    logits_processors: tuple[LogitsProcessor, ...] = ()
    argmax_invariant_processors: tuple[LogitsProcessor, ...] = ()


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] logprob of the sampled token
    ranks: torch.Tensor | None = None  # [B] rank of the sampled token (1 = most likely)
    top_ids: torch.Tensor | None = None  # [B, K]
    top_logprobs: torch.Tensor | None = None  # [B, K]


class Sampler(ABC):
    """Turns one row of logits per sequence into the next token.

    Contract: greedy rows (temperature 0) take the argmax of the penalised
    logits; rows with a generator draw only from it, so a seeded request gives
    the same tokens whatever else is in the batch. Logprobs are of the model's
    raw distribution (log_softmax of the unprocessed logits). With an
    ``allowed_token_bitmask``, a row samples only tokens whose bit is set; ``logit_bias`` is added before penalties.
    The batch's logits processors run where SamplingBatch says (``apply_processors``).
    """

    def __init__(self, vocab_size: int, options: BaseModel | None = None) -> None:
        self.vocab_size = vocab_size
        self.options = options

    @abstractmethod
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput: ...

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B, V] the distribution each random row samples from, after every mask,
        penalty and shaping step. Speculative decoding verifies drafts against it."""
        raise NotImplementedError(f"{type(self).__name__} cannot give its sampling distribution")
