"""Tokenization and chat templating off the event loop.

A 10 MB prompt takes seconds to tokenize; on the event loop that stalls /health and
every stream. Here a few worker threads do it, each with its own Tokenizer: a Rust
tokenizer's settings (truncation, special-token splitting) are per object, so no
object is ever shared across threads.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from modserve.server.chat_tokenizer import ChatTokenizer

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, path: str, model_dir: str, num_workers: int = 2, chat_template: str | None = None) -> None:
        self.path, self.model_dir, self.chat_template = path, model_dir, chat_template
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="modserve-tokenize")
        self._local = threading.local()

    def _tokenizer(self) -> ChatTokenizer:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = ChatTokenizer(self.path, self.model_dir, self.chat_template)
        return tok

    async def run(self, fn: Callable[[ChatTokenizer], T]) -> T:
        """``fn(tokenizer)`` on a worker thread, awaited from the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(self._tokenizer()))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
