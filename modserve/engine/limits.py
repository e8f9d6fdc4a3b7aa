"""What a request must satisfy on this engine, fixed at start-up: the server and the offline
``LLM`` check requests against it before they reach the engine's thread."""

from __future__ import annotations

from dataclasses import dataclass

from modserve.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineLimits:
    vocab_size: int  # token ids in [0, vocab_size)
    max_model_len: int  # prompt + output tokens of one sequence
    max_num_seqs: int  # sequences running at once: the most samples (n) one request may ask
    max_logprobs: int  # the most top logprobs a request may ask, per token and per prompt token

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, longer than max_model_len={self.max_model_len} "
                "allows (it must leave room for at least one generated token)"
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def validate_params(self, params: SamplingParams) -> None:
        """What a request's settings must satisfy here, beyond SamplingParams' own checks; each
        ValueError starts with the field's name."""
        if params.n > self.max_num_seqs:
            raise ValueError(f"n must be at most max_num_seqs={self.max_num_seqs} (the sequences this "
                             f"engine runs at once), got {params.n}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.max_logprobs:
                raise ValueError(f"{name} must be at most max_logprobs={self.max_logprobs}, got "
                                 f"{getattr(params, name)}")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})")
