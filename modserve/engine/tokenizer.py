"""The tokenizer side of the engine: encode, chat templates, EOS ids, streaming decode.

Encoding untrusted chat content safely is the server's (:mod:`modserve.server.chat_tokenizer`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from modserve.runner.loader import generation_eos_ids


class Tokenizer:
    """Wraps a Hugging Face fast tokenizer loaded from a local directory.

    NOTE: ``self.hf`` may reset the shared backend's truncation/padding on each call,
    as transformers does: give each thread its own Tokenizer.
    """

    def __init__(self, path: str | Path, model_dir: str | Path | None = None,
                 chat_template: str | None = None) -> None:
        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if not getattr(self.hf, "is_fast", False):
            raise ValueError(f"tokenizer at {path} is not a fast (tokenizers-backed) tokenizer")
        if chat_template is not None:  # the config's chat_template (Jinja text) replaces the tokenizer's
            self.hf.chat_template = chat_template
        self.backend = self.hf.backend_tokenizer
        self.eos_token_ids = generation_eos_ids(model_dir or path)
        if self.hf.eos_token_id is not None:
            self.eos_token_ids.add(self.hf.eos_token_id)
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.hf.chat_template:
            raise ValueError("this tokenizer has no chat template; use completions with a plain prompt")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def stream(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self.backend, skip_special_tokens)


class IncrementalDecoder:
    """Text for one sequence, a token at a time, never splitting a UTF-8 character.

    ``tokenizers``' DecodeStream keeps the byte-level state: a token that ends
    mid-character yields nothing until the character completes.
    """

    __slots__ = ("backend", "stream")

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""
