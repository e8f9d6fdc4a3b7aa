"""Bounds on what one request may ask for, beyond each field's own range.

Each field can be within its range while the request as a whole is not: 1024 prompts
times ``n`` 128 start 131,072 sequences, and 20,000 stop strings are each scanned on
every generated token of every sequence. These checks run before anything is
tokenized or queued, and each 400 names the config key that bounds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modserve.server.errors import invalid

if TYPE_CHECKING:
    from modserve.core.config import EngineConfig
    from modserve.server.protocol import SamplingRequest

# The request fields that ask for N logprobs per token (chat's ``logprobs`` is a bool).
LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
# max_sequences_per_request's default, in batches of max_num_seqs: an eval harness's batch of
# prompts still fits one request, and no request holds the engine for more than a few rounds.
DEFAULT_BATCHES_PER_REQUEST = 8


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_sequences_per_request: int
    max_stop_strings: int
    max_stop_chars: int
    max_stop_token_ids: int
    max_logprobs: int
    max_bad_words: int
    max_bad_words_chars: int
    max_vllm_xargs_bytes: int = 4096

    @classmethod
    def of(cls, config: EngineConfig) -> RequestLimits:
        return cls(
            max_sequences_per_request=config.max_sequences_per_request
            or DEFAULT_BATCHES_PER_REQUEST * config.max_num_seqs,
            max_stop_strings=config.max_stop_strings, max_stop_chars=config.max_stop_chars,
            max_stop_token_ids=config.max_stop_token_ids, max_logprobs=config.max_logprobs,
            max_bad_words=config.max_bad_words, max_bad_words_chars=config.max_bad_words_chars,
            max_vllm_xargs_bytes=config.max_vllm_xargs_bytes)

    def check(self, body: SamplingRequest, num_prompts: int) -> None:
        """A 400 naming the field and the limit for the first bound ``body`` is over."""
        sequences = num_prompts * body.n
        if sequences > self.max_sequences_per_request:
            raise invalid("n" if body.n > 1 else "prompt",
                          f"{num_prompts} prompts x n={body.n} is {sequences} sequences, over "
                          f"max_sequences_per_request={self.max_sequences_per_request}")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.max_stop_strings:
            raise invalid("stop", f"holds {len(stops)} strings, over max_stop_strings={self.max_stop_strings}")
        chars = sum(map(len, stops))
        if chars > self.max_stop_chars:
            raise invalid("stop", f"is {chars} characters in all, over max_stop_chars={self.max_stop_chars}")
        ids = body.stop_token_ids or []
        if len(ids) > self.max_stop_token_ids:
            raise invalid("stop_token_ids", f"holds {len(ids)} token ids, over max_stop_token_ids="
                          f"{self.max_stop_token_ids}")
        for name in LOGPROB_FIELDS:
            value = getattr(body, name, None)
            if type(value) is int and value > self.max_logprobs:
                raise invalid(name, f"asks for {value} logprobs per token, over max_logprobs={self.max_logprobs}")
        self._check_bad_words(body.bad_words or [])
        # every logits processor reads them on each batch change (generate's params have none)
        if xargs := getattr(body, "vllm_xargs", None):
            size = len(json.dumps(xargs))
            if size > self.max_vllm_xargs_bytes:
                raise invalid("vllm_xargs", f"is {size} bytes of JSON, over max_vllm_xargs_bytes="
                              f"{self.max_vllm_xargs_bytes}")

    def _check_bad_words(self, words: list[str]) -> None:
        # Each word is tokenized twice per request, and a word of several tokens checked on every step.
        if len(words) > self.max_bad_words:
            raise invalid("bad_words", f"holds {len(words)} words, over max_bad_words={self.max_bad_words}")
        chars = sum(map(len, words))
        if chars > self.max_bad_words_chars:
            raise invalid("bad_words", f"is {chars} characters in all, over max_bad_words_chars="
                          f"{self.max_bad_words_chars}")
