"""The core's calls into plugins, checked at the seam.

A plugin that returns the wrong type or shape, or raises, is reported where it happened as a
:class:`PluginError` that names it (kind, name, distribution, version: the registration that
made the instance, see :func:`~modserve.core.registry.registration_of`) and says what was
expected and what came back, instead of failing later deep in the core. Every check is O(1)
per call (isinstance, shape tuples, min/max over ids the core reads anyway) and reads nothing
back from the device.
"""

from __future__ import annotations

import reprlib
from types import TracebackType
from typing import Any

import torch

from modserve.core.contracts.proposer import Proposal
from modserve.core.contracts.sampler import SamplerOutput
from modserve.core.registry import PluginError, registration_of


def who(obj: object, kind: str) -> str:
    """``kind 'name' from dist version (plugin 'p')``: the plugin that made ``obj``."""
    reg = registration_of(obj)
    if reg is None:  # made outside the registry (a test's stand-in): its class is all we know
        return f"{kind} {type(obj).__name__!r}"
    return f"{reg.kind} {reg.name!r} from {reg.origin}"


def described(value: Any) -> str:
    """What a plugin returned, for an error message: a tensor's dtype and shape, else its type and value."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} and dtype {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, tuple):
        return f"a tuple ({', '.join(described(v) for v in value[:4])})"
    return f"{type(value).__name__} {reprlib.repr(value)}"


def broke(obj: object, kind: str, call: str, expected: str, got: str) -> PluginError:
    return PluginError(f"{who(obj, kind)}: {call} returned {got}; expected {expected}")


def failed(obj: object, kind: str, call: str, error: Exception) -> PluginError:
    return PluginError(f"{who(obj, kind)}: {call} raised {type(error).__name__}: {error}")


class calling:
    """``with calling(obj, kind, "call()"):`` an exception raised inside the plugin becomes a
    PluginError naming it, chained; a PluginError passes as it is (it names its plugin already:
    a draft model's attention backend inside a proposer)."""

    __slots__ = ("obj", "kind", "call")

    def __init__(self, obj: object, kind: str, call: str) -> None:
        self.obj, self.kind, self.call = obj, kind, call

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(error, Exception) and not isinstance(error, PluginError):
            raise failed(self.obj, self.kind, self.call, error) from error


def sampled_ids(sampler: object, out: Any, rows: int, vocab_size: int) -> list[int]:
    """The token ids of a sampler's output for ``rows`` rows, checked: a SamplerOutput whose
    ``token_ids`` is ``[rows]`` int64, each in the vocabulary."""
    ids = getattr(out, "token_ids", None)
    if (not isinstance(out, SamplerOutput) or not isinstance(ids, torch.Tensor) or ids.shape != (rows,)
            or ids.dtype != torch.int64):
        raise broke(sampler, "sampler", "__call__()", f"a SamplerOutput whose token_ids is an int64 tensor of "
                    f"shape [{rows}]", described(out) if not isinstance(out, SamplerOutput) else
                    f"token_ids {described(ids)}")
    tokens = ids.tolist()  # NOTE: the engine reads them on the host anyway: no extra sync
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        raise broke(sampler, "sampler", "__call__()", f"token ids in [0, {vocab_size})",
                    f"token_ids {reprlib.repr(tokens)}")
    return tokens


def checked_probs(sampler: object, probs: Any, logits: torch.Tensor) -> torch.Tensor:
    """``sampler.probs``' result: a ``[B, V]`` tensor, the logits' shape."""
    if not isinstance(probs, torch.Tensor) or probs.shape != logits.shape:
        raise broke(sampler, "sampler", "probs()", f"a tensor of shape {list(logits.shape)} ([B, V])",
                    described(probs))
    return probs


def checked_proposal(proposer: object, proposal: Any, num_tokens: list[int], vocab_size: int) -> Proposal:
    """A proposer's result: a Proposal with at most ``num_tokens[i]`` ids in the vocabulary for
    sequence ``i``, and ``probs`` None or ``[B, K, V]``."""
    ids = getattr(proposal, "token_ids", None)
    if not isinstance(proposal, Proposal) or not isinstance(ids, list) or len(ids) != len(num_tokens):
        raise broke(proposer, "proposer", "propose()", f"a Proposal with token_ids for {len(num_tokens)} "
                    "sequences", described(proposal))
    for i, (drafts, k) in enumerate(zip(ids, num_tokens)):
        if len(drafts) > k or (len(drafts) and (min(drafts) < 0 or max(drafts) >= vocab_size)):
            raise broke(proposer, "proposer", "propose()", f"at most {k} token ids in [0, {vocab_size}) for "
                        f"sequence {i}", described(drafts))
    p = proposal.probs
    if p is not None and (not isinstance(p, torch.Tensor) or p.dim() != 3 or p.shape[0] != len(ids)
                          or p.shape[2] != vocab_size):
        raise broke(proposer, "proposer", "propose()", f"probs None or of shape [{len(ids)}, K, {vocab_size}]",
                    f"probs {described(p)}")
    return proposal


