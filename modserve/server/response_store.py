"""Stored Responses API answers, for ``GET /v1/responses/{id}`` and ``previous_response_id``.

In this process's memory, at most ``max_stored_responses`` of them: past it the oldest is
evicted. Each holds the response as sent and the conversation it ends (chat messages,
without the request's instructions), which a follow-up continues.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from modserve.server.errors import APIError


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, or a 404 naming ``param``."""
        found = self._items.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id '{response_id}' not found (never stored, stored with store: "
                           f"false, or evicted past max_stored_responses={self.max_size}).", param=param,
                           code="response_not_found")
        return found
