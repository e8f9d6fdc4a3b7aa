"""LoRA resolver: a name it does not know, or one that leaves its source, resolves to nothing;
what it resolves is the adapter named, in a directory; another base model's adapter is refused.

The kit's adapters are a directory (:mod:`.adapter_dirs`); the built-in ``filesystem`` is pointed
at it. A resolver that looks elsewhere (a hub, a bucket) and does not find the kit's adapter
skips the checks that need it, saying so.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from modserve.api import LoRARequest, LoRAResolver
from modserve.testing.conformance.adapter_dirs import ADAPTER, KIT_BASE, OTHER_BASE, OUTSIDE, kit_adapters
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "lora_resolver"


def _resolved(resolver: LoRAResolver, name: str) -> LoRARequest | None:
    """What ``resolve`` gives, None where it refuses with a ValueError (the contract's refusal)."""
    try:
        return resolver.resolve(KIT_BASE, name)
    except ValueError:
        return None


def _finds_the_kit_adapter(implementation: Implementation) -> LoRAResolver:
    resolver = implementation.create()
    if _resolved(resolver, ADAPTER) is None:
        pytest.skip(f"{implementation} does not resolve the kit's adapter {ADAPTER!r} (a directory of adapters, "
                    f"as {kit_adapters()} is): the checks that need it are skipped")
    return resolver


def test_an_unknown_name_resolves_to_nothing(implementation: Implementation) -> None:
    """Contract: a name it does not know gives None (the client then gets a 404), not an error."""
    name = f"kit-no-such-adapter-{uuid.uuid4().hex}"
    got = implementation.create().resolve(KIT_BASE, name)
    assert got is None, f"{implementation} resolved the unknown name {name!r} to {got}; it must return None"


def test_names_outside_its_source_resolve_to_nothing(implementation: Implementation) -> None:
    """Contract: no name reaches outside the resolver's own source: ``../x``, ``a/../../x`` and an
    absolute path give None or a ValueError, never an adapter (a request names any string)."""
    resolver = implementation.create()
    outside = kit_adapters().parent / OUTSIDE
    for name in (f"../{OUTSIDE}", f"{ADAPTER}/../../{OUTSIDE}", str(outside)):
        got = _resolved(resolver, name)
        assert got is None, (f"{implementation} resolved {name!r} to {got.lora_path}, outside its source: a "
                             "request's model name must never reach another directory")


def test_a_resolved_adapter_is_the_one_named(implementation: Implementation) -> None:
    """Contract: the request returned carries the name asked (the server serves it under that name)
    and a directory holding the adapter's ``adapter_config.json``."""
    found = _finds_the_kit_adapter(implementation).resolve(KIT_BASE, ADAPTER)
    assert isinstance(found, LoRARequest), f"{implementation} returned {found!r}, not a LoRARequest"
    assert found.lora_name == ADAPTER, (f"{implementation} resolved {ADAPTER!r} to an adapter named "
                                        f"{found.lora_name!r}: lora_name must be the name asked")
    assert (Path(found.lora_path) / "adapter_config.json").is_file(), (
        f"{implementation} resolved {ADAPTER!r} to {found.lora_path}, which holds no adapter_config.json")


def test_another_base_models_adapter_is_refused(implementation: Implementation) -> None:
    """Contract: an adapter trained on another base model is never served on this one: None, or a
    ValueError whose message says why (the client's 400)."""
    resolver = _finds_the_kit_adapter(implementation)
    try:
        got = resolver.resolve(KIT_BASE, OTHER_BASE)
    except ValueError as e:
        assert str(e), f"{implementation} refused {OTHER_BASE!r} with an empty message: say why"
        return
    assert got is None, (f"{implementation} resolved {OTHER_BASE!r}, an adapter of another base model, for "
                         f"{KIT_BASE!r}: it must be refused")
