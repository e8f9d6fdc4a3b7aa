"""The engine's per-token logprob entries in OpenAI's two shapes.

An engine entry is ``{"token_id", "logprob", "rank", "top": {token_id: logprob}}``.
Token strings are each token decoded alone, as OpenAI reports them.
"""

from __future__ import annotations

import math
from itertools import islice
from typing import Any, Callable

from modserve.server.protocol import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                                      PromptLogprobs, TopLogprob)

TokenText = Callable[[int], str]


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999 is what OpenAI itself reports.
    return x if math.isfinite(x) else -9999.0


def _top(entry: dict[str, Any], num_top: int | None) -> list[tuple[int, float]]:
    # The engine's top is sorted, and may hold more than this field asked for (prompt
    # logprobs are computed once for echo and for prompt_logprobs).
    return list(islice(entry["top"].items(), num_top))


def completion_logprobs(entries: list[dict[str, Any]], token_text: TokenText, offset: int,
                        out: CompletionLogprobs | None = None, num_top: int | None = None) -> CompletionLogprobs:
    """Completions' ``logprobs`` (appended to ``out``); ``offset`` is where the first token's
    text starts in the choice."""
    out = out or CompletionLogprobs()
    for e in entries:
        text = token_text(e["token_id"])
        top = {token_text(t): _finite(lp) for t, lp in _top(e, num_top)}
        top.setdefault(text, _finite(e["logprob"]))  # as vLLM: the sampled token is always listed
        out.tokens.append(text)
        out.token_logprobs.append(_finite(e["logprob"]))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echo_logprobs(prompt_ids: list[int], entries: list[dict[str, Any] | None], token_text: TokenText,
                  num_top: int) -> CompletionLogprobs:
    """The echoed prompt's part of completions' ``logprobs``, as OpenAI's legacy API: its
    first token has no logprob (null) and no top."""
    first = token_text(prompt_ids[0])
    out = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    return completion_logprobs(entries[1:], token_text, len(first), out, num_top)


def prompt_logprobs(entries: list[dict[str, Any] | None], token_text: TokenText, num_top: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, token id -> logprob, rank, text."""
    out: PromptLogprobs = [None]
    for e in entries[1:]:
        own = {str(e["token_id"]): PromptLogprob(logprob=_finite(e["logprob"]), rank=e["rank"],
                                                 decoded_token=token_text(e["token_id"]))}
        for rank, (t, lp) in enumerate(_top(e, num_top), 1):
            own.setdefault(str(t), PromptLogprob(logprob=_finite(lp), rank=rank, decoded_token=token_text(t)))
        out.append(own)
    return out


def chat_logprobs(entries: list[dict[str, Any]], token_text: TokenText) -> ChatLogprobs:
    content = []
    for e in entries:
        text = token_text(e["token_id"])
        top = [TopLogprob(token=token_text(t), logprob=_finite(lp), bytes=list(token_text(t).encode()))
               for t, lp in e["top"].items()]
        content.append(ChatTokenLogprob(token=text, logprob=_finite(e["logprob"]),
                                        bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)
