"""What a request's settings do before it is queued, as vLLM's input processing does: the
prompt cut to its last ``truncate_prompt_tokens``, ``bad_words`` tokenized. The server and
``LLM.generate`` call these (on their own threads); both are no-ops the second time."""

from __future__ import annotations

from typing import Callable

from modserve.core.sampling_params import SamplingParams
from modserve.engine.tokenizer import Tokenizer


def truncate_prompt(token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The last ``truncate_prompt_tokens`` of ``token_ids`` (-1: max_model_len's worth), as
    vLLM's left truncation; all of them when it is None."""
    k = params.truncate_prompt_tokens
    if k is None:
        return token_ids
    k = max_model_len if k == -1 else k
    return token_ids[-k:] if len(token_ids) > k else token_ids


def tokenize_bad_words(params: SamplingParams, encode: Callable[[str], list[int]]) -> None:
    """Fill ``params.bad_words_token_ids`` as vLLM's ``update_from_tokenizer``: each word
    as it starts a text and, when that is another token sequence of the same length (a
    tokenizer that marks a word's leading space), as it follows a space."""
    words = params.bad_words
    strings = isinstance(words, list) and all(isinstance(w, str) for w in words)
    if not words or not strings or params.bad_words_token_ids is not None:
        return  # none, not strings (EngineLimits.validate_params refuses them), or done already
    found: list[list[int]] = []
    for word in words:
        alone = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        found.append(alone)
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            found.append(spaced)
    params.bad_words_token_ids = found


def preprocess_request(tokenizer: Tokenizer, prompt: str | list[int], params: SamplingParams,
                       max_model_len: int) -> list[int]:
    """The prompt's token ids as the engine runs them; ``params``' bad_words tokenized."""
    tokenize_bad_words(params, lambda text: tokenizer.encode(text, add_special_tokens=False))
    token_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return truncate_prompt(token_ids, params, max_model_len)
