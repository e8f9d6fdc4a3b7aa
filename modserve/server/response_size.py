"""A non-streamed response's size, estimated before its request runs: a 400 past max_response_bytes.

A request of a few KB can ask for hundreds of MB of JSON: as in vLLM, every choice
repeats its prompt's logprobs (completions' ``prompt_logprobs`` and the echo's part of
``logprobs``), so 128 choices of a 1,000-token prompt with ``prompt_logprobs: 20`` are
about 200 MB. The estimate counts what each part of the answer costs in JSON at a
typical token (the vocabulary's mean length), each completion at its full
``max_tokens`` (what the request allows, not what it will likely use).

Streams are not bounded here: they are sent in small pieces as tokens come, and a client
that stops reading has its stream aborted (``stream_stall_timeout``, async_engine.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from modserve.server.errors import invalid

# JSON bytes of one part of an answer, besides the text of the tokens it names. A logprob
# prints as up to ~20 characters ("-1.2345678806304932").
CHOICE = 160  # a choice's own fields: index, finish_reason, stop_reason, an empty message
COMPLETION_TOKEN = 34  # completions' logprobs: a token's logprob, text_offset, separators
COMPLETION_TOP = 23  # one entry of its top_logprobs: "text":logprob
PROMPT_TOP = 72  # one prompt_logprobs entry: "id":{"logprob","rank","decoded_token"}
CHAT_TOKEN = 70  # chat's logprobs.content item: token, logprob, bytes, top_logprobs
CHAT_TOP = 53  # one of its top_logprobs: token, logprob, bytes
CHAT_BYTES_PER_CHAR = 4  # "bytes": [116, ...]: up to four characters a byte


@dataclass(frozen=True, slots=True)
class ResponseBound:
    max_bytes: int
    token_chars: int  # a typical token's text: the vocabulary's mean length, rounded up

    @classmethod
    def of(cls, max_bytes: int, vocab: Iterable[str]) -> ResponseBound:
        lengths = [len(t) for t in vocab]
        return cls(max_bytes, max(1, -(-sum(lengths) // max(1, len(lengths)))))

    def check_completion(self, n: int, prompt_lens: list[int], max_tokens: int | None, max_model_len: int,
                         echo: bool, logprobs: int | None, prompt_logprobs: int | None) -> None:
        """A 400 if /v1/completions' answer to these settings may be over max_bytes."""
        self._check(self.completion_parts(n, prompt_lens, max_tokens, max_model_len, echo, logprobs,
                                          prompt_logprobs), n)

    def completion_parts(self, n: int, prompt_lens: list[int], max_tokens: int | None, max_model_len: int,
                         echo: bool, logprobs: int | None, prompt_logprobs: int | None) -> Counter[str]:
        """The estimated JSON bytes of each part of a /v1/completions answer, by the field asking for it."""
        t = self.token_chars
        parts: Counter[str] = Counter()
        for p in prompt_lens:
            made = _most_generated(max_tokens, p, max_model_len)
            parts["n"] += n * CHOICE
            parts["max_tokens"] += n * made * t
            if echo:
                parts["echo"] += n * p * t
            if logprobs is not None:
                per_token = COMPLETION_TOKEN + t + (logprobs + 1) * (COMPLETION_TOP + t)
                parts["logprobs"] += n * ((p if echo else 0) + made) * per_token
            if prompt_logprobs is not None:
                parts["prompt_logprobs"] += n * p * (prompt_logprobs + 1) * (PROMPT_TOP + t)
        return parts

    def check_chat(self, n: int, prompt_len: int, max_tokens: int | None, max_model_len: int,
                   top_logprobs: int | None, prompt_logprobs: int | None) -> None:
        """A 400 if /v1/chat/completions' answer to these settings may be over max_bytes
        (``top_logprobs``: None without logprobs)."""
        t = self.token_chars
        made = _most_generated(max_tokens, prompt_len, max_model_len)
        parts: Counter[str] = Counter(n=n * CHOICE, max_tokens=n * made * t)
        if top_logprobs is not None:
            per_item = t + CHAT_BYTES_PER_CHAR * t
            parts["top_logprobs"] = n * made * (CHAT_TOKEN + per_item + top_logprobs * (CHAT_TOP + per_item))
        if prompt_logprobs is not None:  # once per response on chat
            parts["prompt_logprobs"] = prompt_len * (prompt_logprobs + 1) * (PROMPT_TOP + t)
        self._check(parts, n)

    def _check(self, parts: Counter[str], n: int) -> None:
        total = sum(parts.values())
        if total <= self.max_bytes:
            return
        largest = max(parts, key=lambda k: parts[k])
        raise invalid(largest, f"asks for a response of about {_mib(total)} ({n} choices; {largest} "
                      f"{_mib(parts[largest])} of it), over max_response_bytes={self.max_bytes} "
                      f"({_mib(self.max_bytes)}); ask for fewer choices, tokens or logprobs, or stream it")


def _most_generated(max_tokens: int | None, prompt_len: int, max_model_len: int) -> int:
    room = max(0, max_model_len - prompt_len)
    return room if max_tokens is None else min(max_tokens, room)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
