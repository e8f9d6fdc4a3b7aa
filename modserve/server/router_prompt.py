"""A request's prompt token ids, for the router's prefix scores: the server's own request models,
tokenizer and chat template (``ServerState.encode``, ``chat.chat_prompt``), so the router hashes
the very ids the prefill server will cache."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from modserve.engine.preprocess import truncate_prompt
from modserve.server.chat_tokenizer import ChatTokenizer
from modserve.server.errors import APIError
from modserve.server.protocol import ChatCompletionRequest, CompletionRequest
from modserve.server.tokenizer_pool import TokenizerPool
from modserve.server.tool_calls import template_inputs

logger = logging.getLogger("modserve.router")


class PromptTokenizer:
    """``tokenizer``: the model's directory (or its tokenizer's), as ``serve --tokenizer``;
    ``chat_template``: the servers' ``--chat-template`` (Jinja text), if they were given one."""

    def __init__(self, tokenizer: str, chat_template: str | None = None, num_workers: int = 2) -> None:
        if not Path(tokenizer).is_dir():
            raise ValueError(f"--tokenizer {tokenizer}: no such directory (give the model's, or its tokenizer's)")
        try:  # at start, not at the first request: a wrong path is the operator's to hear of
            ChatTokenizer(tokenizer, tokenizer, chat_template)
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer {tokenizer}: {e}") from None
        self.pool = TokenizerPool(tokenizer, tokenizer, num_workers, chat_template)

    async def prompts(self, path: str, body: Any) -> list[list[int]]:
        """Each prompt's ids as the server will tokenize them; [] for a body the server will refuse
        (it says why in its 400) or whose template fails."""
        if not isinstance(body, dict):
            return []
        try:
            if path == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(body)
                messages = [m.as_template_input() for m in chat.messages]
                inputs = template_inputs(chat)
                ids = await self.pool.run(lambda tok: tok.encode_chat(messages, chat.generation_prompt, False, inputs))
                return [self._truncated(ids, chat)]
            completion = CompletionRequest.model_validate(body)
            return [self._truncated(await self._encode(p) if isinstance(p, str) else list(p), completion)
                    for p in completion.prompts()]
        except (ValidationError, ValueError, APIError) as e:
            logger.debug("no prefix score for a request the server will refuse: %s", e)
            return []

    async def _encode(self, text: str) -> list[int]:
        return await self.pool.run(lambda tok: tok.encode(text))  # as ServerState.encode

    @staticmethod
    def _truncated(ids: list[int], body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        # NOTE: -1 (max_model_len's worth) keeps them all here: a longer prompt is refused anyway.
        return truncate_prompt(ids, body, len(ids))  # reads only truncate_prompt_tokens

    def close(self) -> None:
        self.pool.close()
