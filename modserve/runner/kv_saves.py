"""A KV connector's saves, which never fail a request: a store that is full, unwritable or
broken costs the blocks of the step, not the step (the requests go on, their tokens computed
as without a connector). Each failure is counted; each kind of it is logged once."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from modserve.core.contracts.kv_connector import BlockTransfer, KVConnector
from modserve.core.plugin_calls import who

logger = logging.getLogger("modserve")


class GuardedSaves:
    """One step's saves through ``connector``: ``save_layer`` per layer, then ``finish``.

    After a ``save_layer`` that raised, the step's later layers are not offered (their blocks
    are lost anyway) and ``finish_saves`` is still called, so that the connector drops what it
    took; see the contract. ``failures`` counts the steps whose saves raised.
    """

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector
        self.failures = 0
        self._logged: set[tuple[str, str, int | None]] = set()  # (call, exception type, errno)
        self._failed = False  # a call of this step raised

    def layer_hook(self, transfers: list[BlockTransfer]) -> Callable[[int, torch.Tensor], None]:
        """The after-each-layer hook of one step that saves ``transfers``."""
        self._failed = False

        def save(layer: int, kv_cache: torch.Tensor) -> None:
            if not self._failed:
                self._call("save_layer()", lambda: self.connector.save_layer(layer, kv_cache, transfers))
        return save

    def finish(self) -> None:
        self._call("finish_saves()", self.connector.finish_saves)

    def _call(self, call: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # an OSError (no space, no permission) or a plugin's own fault
            self.failures += not self._failed  # one per step
            self._failed = True
            kind = (call, type(e).__name__, getattr(e, "errno", None))
            if kind not in self._logged:
                self._logged.add(kind)
                logger.warning("%s: %s raised %s: %s; this step's blocks are not stored, its requests go on "
                               "(further failures of this kind are only counted: "
                               "modserve_kv_connector_save_failures_total)", who(self.connector, "kv_connector"),
                               call, type(e).__name__, e)
