"""What a request must satisfy on this engine, fixed at start-up: the server and the offline
``LLM`` check requests against it before they reach the engine's thread."""

from __future__ import annotations

from dataclasses import dataclass

from modserve.core.contracts.logits_processor import LogitsProcessor
from modserve.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineLimits:
    vocab_size: int  # token ids in [0, vocab_size)
    max_model_len: int  # prompt + output tokens of one sequence
    max_num_seqs: int  # sequences running at once: the most samples (n) one request may ask
    max_logprobs: int  # the most top logprobs a request may ask, per token and per prompt token
    logits_processors: tuple[type[LogitsProcessor], ...] = ()  # the engine's: each checks a request's extra_args

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
        self._validate_token_rules(params)
        for cls in self.logits_processors:
            cls.validate_params(params)

    def _validate_token_rules(self, params: SamplingParams) -> None:
        """logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM checks them in
        its engine too): ids in the vocabulary, so a row's work is at most the vocabulary."""
        bias, allowed, k = params.logit_bias, params.allowed_token_ids, params.truncate_prompt_tokens
        if bias is not None:
            self._check_ids("logit_bias", list(bias) if isinstance(bias, dict) else [bias])
            bad = next((b for b in bias.values() if isinstance(b, bool) or not isinstance(b, (int, float))
                        or not -100 <= b <= 100), None)
            if bad is not None:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100] (OpenAI's range), got {bad!r}")
        if allowed is not None:
            if not isinstance(allowed, list) or not allowed or len(allowed) > self.vocab_size:
                raise ValueError(f"allowed_token_ids must be a non-empty list of at most {self.vocab_size} ids")
            self._check_ids("allowed_token_ids", allowed)
        if params.bad_words:
            self._check_bad_words(params)
        if k is not None and (not _is_int(k) or not (k == -1 or 1 <= k <= self.max_model_len)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, max_model_len="
                             f"{self.max_model_len}], got {k!r}")

    def _check_bad_words(self, params: SamplingParams) -> None:
        words = params.bad_words
        if not isinstance(words, list) or any(not isinstance(w, str) or not w.strip() for w in words):
            raise ValueError("bad_words must be a list of strings, none empty or only spaces")
        if params.bad_words_token_ids is None:  # the runner could not ban them: never silently ignored
            raise ValueError("bad_words were not tokenized (engine/preprocess.py's preprocess_request)")
        self._check_ids("bad_words", [t for ids in params.bad_words_token_ids for t in ids])

    def _check_ids(self, name: str, ids: list) -> None:
        bad = next((t for t in ids if not _is_int(t) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name} holds {bad!r}, not a token id in the vocabulary [0, {self.vocab_size})")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
