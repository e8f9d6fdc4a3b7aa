"""The checkpoint's sampling defaults, its ``generation_config.json``, applied as vLLM applies them.

vLLM (``ModelConfig.get_diff_sampling_param``) reads six fields of the file,
``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``max_new_tokens``
(as ``max_tokens``), and a request that leaves one unset gets the file's value instead of the
neutral one; a request's own value wins. ``override_generation_config`` is merged over the
file, and applies with ``generation_config: vllm`` too (which ignores the file).

NOTE: ``do_sample`` is not read, as vLLM does not read it: ``do_sample: false`` beside
``temperature: 0.6`` samples at 0.6. Greedy decoding is ``temperature: 0`` (or ``top_k: 1``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modserve.core.config import EngineConfig
from modserve.core.sampling_params import SamplingParams

logger = logging.getLogger("modserve")

FILE = "generation_config.json"
# Hugging Face's name -> SamplingParams' (vLLM's available_params).
FIELDS: dict[str, str] = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                          "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a request gets for the sampling fields it leaves unset, and a cap on its max_tokens."""

    values: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    # vLLM's override_max_tokens: every request's max_tokens, its own too, is at most this
    # (override_generation_config's max_new_tokens; with generation_config: DIR, the DIR's).
    max_tokens_cap: int | None = None

    @classmethod
    def of(cls, config: EngineConfig) -> "GenerationDefaults":
        """The defaults ``config`` asks for, checked as a request's would be, and logged when
        there are any. A ValueError names the file or key at fault."""
        found, source = read_generation_config(config)
        override = dict(config.override_generation_config or {})
        ignored = sorted(set(override) - set(FIELDS))
        if ignored:  # vLLM drops them silently
            logger.warning("override_generation_config: %s ignored (the sampling defaults taken are %s)",
                           ", ".join(ignored), ", ".join(FIELDS))
        merged = {**found, **override}
        values = {FIELDS[k]: v for k, v in merged.items() if k in FIELDS and v is not None}
        by_dir = config.generation_config not in ("auto", "vllm")
        defaults = cls(values, values.get("max_tokens") if by_dir else override.get("max_new_tokens"))
        where = " and ".join(filter(None, [source, "override_generation_config" if override else ""]))
        try:
            defaults.sampling_params()
        except ValueError as e:  # SamplingParams' message names the field
            raise ValueError(f"sampling defaults from {where}: {e}") from None
        if values:  # vLLM warns too: the model, not the client, now decides how unset fields sample
            hint = "; --generation-config vllm ignores the file" if source else ""
            logger.warning("default sampling parameters from %s: %s (a request's own values win%s)",
                           where, describe(values), hint)
        return defaults

    def sampling_params(self) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params()``: a new SamplingParams of these defaults."""
        return SamplingParams(**self.values)

    def max_tokens(self, requested: int | None) -> int | None:
        """vLLM's ``get_max_tokens``: the request's, else the default, at most the cap (None: up
        to the context's end)."""
        value = requested if requested is not None else self.values.get("max_tokens")
        if self.max_tokens_cap is None or (value is not None and value <= self.max_tokens_cap):
            return value
        return self.max_tokens_cap


def read_generation_config(config: EngineConfig) -> tuple[dict[str, Any], str]:
    """The file ``generation_config`` names (its mapping and path), or ``({}, "")``: with ``vllm``,
    or ``auto`` for a model without one. A directory given that has none is an error."""
    choice = config.generation_config
    if choice == "vllm":
        return {}, ""
    path = Path(config.model if choice == "auto" else choice).expanduser() / FILE
    if not path.is_file():
        if choice == "auto":
            return {}, ""
        raise ValueError(f"generation_config: {choice} holds no {FILE}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data, str(path)


def describe(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())
