"""The prompt forms ``LLM.generate`` takes, as vLLM's ``vllm.inputs``: a ``str``, a
:class:`TextPrompt`, a :class:`TokensPrompt`, a list of token ids, or a list of any of them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (special tokens added, as for a ``str``)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A tokenized prompt, given to the model as it is."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from: the output's ``prompt``


PromptType = str | list[int] | TextPrompt | TokensPrompt

ACCEPTED = ("a str, a list of token ids, a TextPrompt {'prompt': str}, a TokensPrompt "
            "{'prompt_token_ids': [int, ...]}, or a list of these")
# vLLM's other prompt forms: refused by name, so none is silently dropped.
UNSUPPORTED_KEYS = {
    "prompt_embeds": "EmbedsPrompt (prompt embeddings) is not supported",
    "encoder_prompt": "encoder/decoder prompts are not supported: modserve runs decoder-only models",
    "decoder_prompt": "encoder/decoder prompts are not supported: modserve runs decoder-only models",
    "multi_modal_data": "multimodal inputs are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "multi_modal_uuids": "multimodal inputs are not supported",
    "cache_salt": "cache_salt is not supported: the prefix cache is shared by every request",
    "token_type_ids": "token_type_ids are not supported",
}


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """One prompt as the engine takes it (text to tokenize, or token ids) and the text a
    RequestOutput reports (None for token ids given without one)."""

    engine_input: str | list[int]
    text: str | None


def parse_prompts(prompts: Any) -> list[ParsedPrompt]:
    """Every prompt of ``prompts`` (one prompt or a list of them); a TypeError or ValueError
    naming the forms accepted, before anything reaches the engine."""
    if isinstance(prompts, (str, dict)):
        return [_parse_one(prompts, "prompts")]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be {ACCEPTED}; got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], Integral):  # one tokenized prompt
        return [ParsedPrompt(_token_ids(prompts, "prompts"), None)]
    return [_parse_one(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _parse_one(prompt: Any, where: str) -> ParsedPrompt:
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, prompt)
    if isinstance(prompt, (list, tuple)):
        return ParsedPrompt(_token_ids(prompt, where), None)
    if not isinstance(prompt, dict):
        raise TypeError(f"{where} must be {ACCEPTED}; got {type(prompt).__name__}")
    for key, value in prompt.items():
        if key in ("prompt", "prompt_token_ids") or (value is None and key in UNSUPPORTED_KEYS):
            continue
        why = UNSUPPORTED_KEYS.get(key, "modserve takes 'prompt' (TextPrompt) and 'prompt_token_ids' (TokensPrompt)")
        raise ValueError(f"{where}: key {key!r}: {why}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{where}['prompt'] must be a str, got {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        return ParsedPrompt(_token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']"), text)
    if text is None:
        raise ValueError(f"{where}: a prompt dict needs 'prompt' (TextPrompt) or 'prompt_token_ids' "
                         f"(TokensPrompt), got keys {sorted(prompt)}")
    return ParsedPrompt(text, text)


def _token_ids(ids: Any, where: str) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, Integral) and not isinstance(t, bool)
                                                      for t in ids):
        raise TypeError(f"{where} must be a list of integer token ids")
    return [int(t) for t in ids]
