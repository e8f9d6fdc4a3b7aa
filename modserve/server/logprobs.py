"""The engine's per-token logprob entries in OpenAI's two shapes.

An engine entry is ``{"token_id", "logprob", "rank", "top": {token_id: logprob}}``.
Token strings are each token decoded alone, as OpenAI reports them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from modserve.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

TokenText = Callable[[int], str]


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999 is what OpenAI itself reports.
    return x if math.isfinite(x) else -9999.0


def completion_logprobs(entries: list[dict[str, Any]], token_text: TokenText, offset: int) -> CompletionLogprobs:
    """Completions' ``logprobs``; ``offset`` is where the first token's text starts in the choice."""
    out = CompletionLogprobs()
    for e in entries:
        text = token_text(e["token_id"])
        top = {token_text(t): _finite(lp) for t, lp in e["top"].items()}
        top.setdefault(text, _finite(e["logprob"]))  # as vLLM: the sampled token is always listed
        out.tokens.append(text)
        out.token_logprobs.append(_finite(e["logprob"]))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
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
