"""Per-request sampling settings, validated when the request is made."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from modserve.core.structured_outputs import StructuredOutputs


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny
# vLLM's _MAX_TEMP: a smaller non-zero temperature is raised to it. Far below it logits / t
# overflow float32 to inf and sampling picks garbage (1e-40 took the least likely token).
MIN_TEMPERATURE = 1e-2
INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Mirrors vLLM's ``SamplingParams``.

    ``temperature == 0`` is greedy; one in (0, 0.01) is raised to 0.01, as vLLM does.
    ``top_k <= 0`` (or -1) disables top-k.
    ``logprobs=N`` returns the sampled token's logprob and the top N alternatives.
    ``prompt_logprobs=N`` returns each prompt token's logprob given the tokens before it, and
    the top N there (0: its own only). Such a prompt is computed in full: it skips the prefix
    cache, whose hits have no logits. With it, ``max_tokens=0`` is allowed: the request ends
    after its prefill with finish_reason "length" and no tokens (the server's echo scoring).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (so no stop strings), as vLLM's
    spaces_between_special_tokens: bool = True  # vLLM's; False only while special tokens are skipped (no-op)
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None  # constrain the output (JSON schema, regex, ...)
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to its logit
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # never generated (vLLM's rule: engine/preprocess.py, runner/sampling.py)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    # Arguments for the engine's logits processors (vLLM's; the server's vllm_xargs), read by each in update_state
    extra_args: dict[str, Any] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, compare=False)  # set when added

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        self.validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"{field_name} {why}, got {getattr(self, field_name)!r}")

        # Values reach int64 tensors and float32 maths: out of range there is an error
        # inside a step, so it is refused here, naming the field.
        for name in INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not INT64_MIN <= value <= INT64_MAX):
                raise bad(name, "must be an integer in the 64-bit range")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in ("top_p", "repetition_penalty"):
            # Divisors and thresholds in float32: below its smallest normal they become 0.
            if 0 < getattr(self, name) < FLOAT32_TINY:
                raise bad(name, f"must be at least {FLOAT32_TINY:.3g} (it is used in float32)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings (an empty one would match everywhere)")
        if any(not isinstance(t, int) or t > INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be integer token ids")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise bad("max_tokens", "must be at least 1 (0 only with prompt_logprobs)")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative token ids")
        if self.stop and not self.detokenize:
            raise bad("stop", "needs detokenize=True: stop strings are searched in the text, as in vLLM")
        if not (self.spaces_between_special_tokens or self.skip_special_tokens):
            raise bad("spaces_between_special_tokens", "must be true with skip_special_tokens false (not supported)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "must be a StructuredOutputs")
        if self.extra_args is not None and (not isinstance(self.extra_args, dict)
                                            or not all(isinstance(k, str) for k in self.extra_args)):
            raise bad("extra_args", "must be a dict with string keys")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self) -> "SamplingParams":
        """A deep copy, as vLLM's ``SamplingParams.clone()``: changing it leaves this one as it is."""
        return copy.deepcopy(self)
