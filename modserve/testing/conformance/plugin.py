"""The pytest plugin of the conformance kit (entry point ``pytest11: modserve``).

Every kit module names its kind (``CONFORMANCE_KIND``); a test there that takes the
``implementation`` argument runs once per implementation of that kind, with an id that
names it (``test_x[attention_backend:paged]``). ``--modserve-conformance KIND:NAME``
(repeatable) checks exactly those; tests of other kinds are then deselected. Without it,
every implementation the registry knows is checked.

NOTE: pytest loads this module in every run where modserve is installed, so it does nothing
unless a kit module is collected or its options are given: it never touches the registry
otherwise. (Importing it imports :mod:`modserve.testing`, and with it torch.)
"""

from __future__ import annotations

from typing import Iterator

import pytest

from modserve.testing.conformance.targets import Selection, selection

_SELECTION = pytest.StashKey[Selection]()
_UNSELECTED = "modserve_conformance_unselected"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("modserve", "modserve conformance kit")
    group.addoption("--modserve-conformance", action="append", default=[], metavar="KIND:NAME",
                    help="check only this implementation (repeatable), e.g. attention_backend:myattn; "
                         "default: every registered implementation of every kind")
    group.addoption("--modserve-conformance-options", action="append", default=[], metavar="KIND:NAME=JSON",
                    help="options to build that implementation with (repeatable), e.g. "
                         "'proposer:draft_model={\"model\": \"/path/to/draft\"}'")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{_UNSELECTED}: a kit test of a kind the targets do not name")
    chosen = selection(config.getoption("--modserve-conformance"),
                       config.getoption("--modserve-conformance-options"))
    if chosen.named is not None or chosen.options:
        chosen.check()  # fail at start-up, listing what is available, not per test
    config.stash[_SELECTION] = chosen


def pytest_report_header(config: pytest.Config) -> str | None:
    chosen = config.stash.get(_SELECTION, None)
    if chosen is None or chosen.named is None:
        return None
    targets = ", ".join(f"{k}:{n}" for k, names in chosen.named.items() for n in names)
    return f"modserve conformance: {targets} (kit tests of other kinds are deselected)"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    kind = getattr(metafunc.module, "CONFORMANCE_KIND", None)
    if kind is None or "implementation" not in metafunc.fixturenames:
        return  # not a kit test: leave it alone
    found = metafunc.config.stash[_SELECTION].implementations(kind)
    if found is None:
        params = [pytest.param(None, marks=pytest.mark.modserve_conformance_unselected, id=f"{kind}:unselected")]
    elif not found:
        params = [pytest.param(None, marks=pytest.mark.skip(reason=f"no {kind} is registered"), id=f"{kind}:none")]
    else:
        params = [pytest.param(impl, id=str(impl)) for impl in found]
    # Module scope: a kit module's fixtures may build one instance per implementation.
    metafunc.parametrize("implementation", params, scope="module")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unselected = [item for item in items if item.get_closest_marker(_UNSELECTED)]
    if unselected:
        config.hook.pytest_deselected(items=unselected)
        items[:] = [item for item in items if not item.get_closest_marker(_UNSELECTED)]


@pytest.fixture
def modserve_one_thread() -> Iterator[None]:
    """For kit modules (``usefixtures``): their tensors are tiny, extra intra-op threads only
    add contention. Not autouse: other tests never see it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

