"""GrammarBackend and GrammarMatcher: masks, acceptance, EOS, rollback and reset.

For each constraint kind the backend declares (``kinds``), one small spec over a byte-level
vocabulary of 107 tokens (:mod:`.grammar_specs`); a matcher walks one accepted string token by
token and is checked at every step.
"""

from __future__ import annotations

import pytest

from modserve.api import GrammarBackend, GrammarMatcher, GrammarSpec
from modserve.testing.conformance.grammar_specs import (
    CASES, EOS, TOKEN_ID, VOCAB, KindCase, allowed, may_follow, spell)
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "grammar_backend"
KINDS = sorted(CASES)


@pytest.fixture(scope="module")
def backend(implementation: Implementation) -> GrammarBackend:
    return implementation.create(VOCAB)


def matcher_for(backend: GrammarBackend, kind: str, max_rollback: int = 8) -> tuple[GrammarMatcher, KindCase]:
    if kind not in backend.kinds:
        pytest.skip(f"{type(backend).__name__} does not take {kind} constraints (kinds: {sorted(backend.kinds)})")
    case = CASES[kind]
    return backend.matcher(backend.compile(case.spec), max_rollback), case


def accept(matcher: GrammarMatcher, token: bytes, text: bytes) -> None:
    assert matcher.accept_token(TOKEN_ID[token]), (
        f"after {text!r}, accept_token({token!r}) refused a token the walk needs")


@pytest.mark.parametrize("kind", KINDS)
def test_bitmask_is_exactly_what_may_come_next(implementation: Implementation, backend: GrammarBackend,
                                               kind: str) -> None:
    """At every step of an accepted string ``fill_bitmask`` sets exactly the tokens that may come
    next (EOS only where the constraint may end), overwriting its row and no other."""
    m, case = matcher_for(backend, kind)
    text = b""
    for token in (*case.walk, None):
        got = allowed(m)
        if case.language is not None:
            want = may_follow(case.language, text)
            assert got == want, (f"{case.spec.describe()}: after {text!r} the bitmask allows {spell(got)}; exactly "
                                 f"{spell(want)} may come next (extra: {spell(got - want)}, "
                                 f"missing: {spell(want - got)})")
        else:
            assert token is None or TOKEN_ID[token] in got, f"after {text!r} the bitmask refuses {token!r}"
            assert (EOS in got) == (token is None), f"after {text!r} EOS is {'' if EOS in got else 'not '}allowed"
        if token is not None:
            accept(m, token, text)
            text += token
    assert not m.is_terminated(), f"{case.spec.describe()}: terminated after {text!r} without EOS"
    assert m.accept_token(EOS) and m.is_terminated(), f"after {text!r} EOS must be accepted and terminate"


@pytest.mark.parametrize("kind", KINDS)
def test_refused_tokens_change_nothing(implementation: Implementation, backend: GrammarBackend, kind: str) -> None:
    """``accept_token`` of a token the constraint forbids (EOS before the end included) returns
    False and leaves the matcher as it was."""
    m, case = matcher_for(backend, kind)
    text = b""
    for step, token in enumerate(case.walk):
        before = allowed(m)
        refused = [TOKEN_ID[case.refused_first]] if step == 0 else []  # forbidden by the constraint
        refused += sorted({EOS, *range(3, VOCAB.vocab_size)} - before)[::17]  # and by its own bitmask
        for bad in refused:
            assert not m.accept_token(bad), (
                f"after {text!r}, accept_token({spell({bad})[0]}) accepted a forbidden token")
            assert allowed(m) == before and not m.is_terminated(), (
                f"after {text!r}, the refused {spell({bad})[0]} changed what the matcher allows")
        accept(m, token, text)
        text += token


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_restores_earlier_states(implementation: Implementation, backend: GrammarBackend, kind: str) -> None:
    """``rollback(n)`` undoes the last ``n`` tokens, a terminating EOS included: the matcher allows
    what it allowed then, and takes the same tokens again."""
    m, case = matcher_for(backend, kind, max_rollback=len(CASES[kind].walk) + 1)
    masks, text = [allowed(m)], b""
    for token in case.walk:
        accept(m, token, text)
        text += token
        masks.append(allowed(m))
    assert m.accept_token(EOS) and m.is_terminated(), f"after {text!r} EOS must be accepted and terminate"
    m.rollback(1)
    assert not m.is_terminated() and allowed(m) == masks[-1], "rollback(1) after EOS must undo the termination"
    m.rollback(2)
    back = b"".join(case.walk[:-2])
    assert allowed(m) == masks[-3], (f"rollback(2) must return to the state after {back!r}: it allows "
                                     f"{spell(allowed(m))}, that state allowed {spell(masks[-3])}")
    for token in case.walk[-2:]:
        accept(m, token, back)
        back += token
    assert allowed(m) == masks[-1] and m.accept_token(EOS), "after rolling back and re-accepting, EOS must end it"


@pytest.mark.parametrize("kind", KINDS)
def test_reset_returns_to_the_start(implementation: Implementation, backend: GrammarBackend, kind: str) -> None:
    """``reset`` (after some tokens, and after termination) returns the matcher to the start."""
    m, case = matcher_for(backend, kind)
    start, text = allowed(m), b""
    accept(m, case.walk[0], text)
    m.reset()
    assert allowed(m) == start and not m.is_terminated(), f"reset after {case.walk[0]!r} must return to the start"
    for token in case.walk:
        accept(m, token, text)
        text += token
    assert m.accept_token(EOS)
    m.reset()
    assert allowed(m) == start and not m.is_terminated(), "reset after EOS must return to the start"


@pytest.mark.parametrize("kind", KINDS)
def test_a_deserialized_grammar_makes_the_same_matcher(implementation: Implementation, backend: GrammarBackend,
                                                      kind: str) -> None:
    """``serialize`` gives bytes, and another instance's ``deserialize`` of them (a compile worker
    process hands its result to the engine's process so) makes a matcher that allows at every
    step what the original's does."""
    if kind not in backend.kinds:
        pytest.skip(f"{type(backend).__name__} does not take {kind} constraints (kinds: {sorted(backend.kinds)})")
    case = CASES[kind]
    compiled = backend.compile(case.spec)
    try:
        data = backend.serialize(compiled)
    except Exception as e:  # noqa: BLE001 - which exception is the point
        pytest.fail(f"serialize(compile({case.spec.describe()})) raised {type(e).__name__}: {e}; a compiled "
                    "grammar that does not pickle needs serialize and deserialize of the backend's own")
    assert isinstance(data, bytes), f"serialize returned {type(data).__name__}; expected bytes"
    original = backend.matcher(compiled, 8)
    restored = backend.matcher(implementation.create(VOCAB).deserialize(data), 8)
    text = b""
    for token in (*case.walk, None):
        assert allowed(restored) == allowed(original), (
            f"{case.spec.describe()}: after {text!r} the deserialized grammar's matcher allows "
            f"{spell(allowed(restored))}, the original's {spell(allowed(original))}")
        if token is not None:
            accept(original, token, text)
            accept(restored, token, text)
            text += token


def test_compile_refuses_an_invalid_regex_with_value_error(implementation: Implementation,
                                                          backend: GrammarBackend) -> None:
    """``compile`` raises ValueError (its message reaches the user) for a spec it cannot compile."""
    if "regex" not in backend.kinds:
        pytest.skip(f"{type(backend).__name__} does not take regex constraints")
    raised: Exception | None = None
    try:
        backend.compile(GrammarSpec("regex", "ab("))
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001 - which exception is the point
        raised = e
    what = f"raised {type(raised).__name__}: {raised}" if raised else "accepted an unbalanced parenthesis"
    pytest.fail(f"compile(regex 'ab(') {what}; a refused spec must be a ValueError (its message reaches the user)")
