"""Sampler: greedy, seeded and random rows on fixed logits, masks, and raw logprobs.

Frequencies are checked over 8000 draws from a vocabulary of 8 (one sampler call of 8000 identical
rows): each token within 5 standard deviations of its probability, tokens of probability 0
never drawn. The global RNG is seeded per test (restored after), so a result is reproducible.
"""

from __future__ import annotations

import math
from typing import Iterator

import pytest
import torch

from modserve.api import Sampler, SamplerOutput
from modserve.testing.conformance.sampling_batches import batch, bitmask_of, expected_probs
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "sampler"
pytestmark = pytest.mark.usefixtures("modserve_one_thread", "seeded_rng")

PROBS = [0.3, 0.2, 0.15, 0.12, 0.09, 0.07, 0.05, 0.02]  # distinct: top-k and top-p cut unambiguously
LOGITS = torch.tensor(PROBS).log()  # [8]
DRAWS = 8000
SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (2.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.35), (0.7, 4, 1.0, 0.0), (1.5, 0, 0.8, 0.0),
]


def setting_id(s: tuple[float, int, float, float]) -> str:
    return f"t{s[0]}-k{s[1]}-p{s[2]}-minp{s[3]}"


@pytest.fixture
def seeded_rng() -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def sample(sampler: Sampler, logits: torch.Tensor, **settings: object) -> SamplerOutput:
    out = sampler(logits.clone(), batch(logits.shape[0], **settings))
    b, v = logits.shape
    ids = out.token_ids
    assert isinstance(ids, torch.Tensor) and tuple(ids.shape) == (b,) and ids.dtype == torch.int64, (
        f"token_ids must be [B] = [{b}] int64, got {getattr(ids, 'shape', ids)} {getattr(ids, 'dtype', '')}")
    assert bool(((ids >= 0) & (ids < v)).all()), f"token ids outside [0, {v}): {ids[(ids < 0) | (ids >= v)][:5]}"
    return out


def assert_frequencies(tokens: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Each token's frequency within 5 sigma of its probability; impossible tokens never drawn."""
    n = tokens.numel()
    freq = torch.bincount(tokens, minlength=expected.numel()).double() / n
    for t, (f, p) in enumerate(zip(freq.tolist(), expected.tolist())):
        if p == 0:
            assert f == 0, f"{what}: token {t} has probability 0 but was drawn {f * n:.0f} times of {n}"
        else:
            bound = 5 * math.sqrt(p * (1 - p) / n) + 1 / n
            assert abs(f - p) <= bound, (f"{what}: token {t} drawn with frequency {f:.4f} over {n} draws; "
                                         f"its probability is {p:.4f} (tolerance {bound:.4f})")


def test_greedy_rows_take_the_argmax(implementation: Implementation) -> None:
    """Temperature 0 takes the argmax, in an all-greedy batch and beside random rows."""
    logits = torch.randn(16, 50)
    sampler = implementation.create(50)
    got = sample(sampler, logits, temperature=0.0).token_ids
    assert torch.equal(got, logits.argmax(-1)), f"greedy rows must take the argmax {logits.argmax(-1)}, got {got}"
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(16)]
    got = sample(sampler, logits, temperature=temps, top_k=5).token_ids
    assert torch.equal(got[::2], logits[::2].argmax(-1)), (
        f"greedy rows beside random ones must take the argmax {logits[::2].argmax(-1)}, got {got[::2]}")


@pytest.mark.parametrize("setting", SETTINGS, ids=setting_id)
def test_sampling_follows_the_distribution(implementation: Implementation,
                                           setting: tuple[float, int, float, float]) -> None:
    """Random rows draw from softmax(logits / temperature) restricted by top-k, top-p and min-p."""
    temperature, top_k, top_p, min_p = setting
    out = sample(implementation.create(8), LOGITS.expand(DRAWS, 8), temperature=temperature, top_k=top_k,
                 top_p=top_p, min_p=min_p)
    assert_frequencies(out.token_ids, expected_probs(LOGITS, temperature, top_k, top_p, min_p), setting_id(setting))


@pytest.mark.parametrize("setting", SETTINGS, ids=setting_id)
def test_probs_is_the_sampling_distribution(implementation: Implementation,
                                            setting: tuple[float, int, float, float]) -> None:
    """``probs`` (speculative decoding verifies drafts against it) is the distribution sampled from."""
    temperature, top_k, top_p, min_p = setting
    try:
        got = implementation.create(8).probs(LOGITS.expand(2, 8).clone(),
                                             batch(2, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    except NotImplementedError:
        pytest.skip(f"{implementation} does not give its sampling distribution (probs)")
    want = expected_probs(LOGITS, temperature, top_k, top_p, min_p)
    assert tuple(got.shape) == (2, 8), f"probs must be [B, V] = [2, 8], got {tuple(got.shape)}"
    assert torch.allclose(got.double(), want.expand(2, 8), atol=1e-5), (
        f"{setting_id(setting)}: probs gave {got[0].tolist()}, the distribution is {want.tolist()}")


def test_seeded_rows_follow_the_distribution(implementation: Implementation) -> None:
    """A row with a generator draws from the same distribution as any other (one seed per row)."""
    out = sample(implementation.create(8), LOGITS.expand(DRAWS, 8), seeds={row: row for row in range(DRAWS)})
    assert_frequencies(out.token_ids, expected_probs(LOGITS), "seeded rows")


def test_seeded_rows_do_not_depend_on_the_batch(implementation: Implementation) -> None:
    """The same seed gives the same tokens, draw after draw, alone or at another row among
    unseeded and other seeded rows: a seeded row draws only from its generator."""
    sampler = implementation.create(8)
    alone, crowded = batch(1, seeds={0: 1234}), batch(5, seeds={3: 1234, 1: 99})
    ours, theirs = [], []
    for _ in range(20):
        ours.append(int(sampler(LOGITS.expand(1, 8).clone(), alone).token_ids[0]))
        theirs.append(int(sampler(LOGITS.expand(5, 8).clone(), crowded).token_ids[3]))
    assert ours == theirs, (f"seed 1234 drew {ours} alone and {theirs} as row 3 of 5: a seeded row must not "
                            f"depend on the other rows")
    assert len(set(ours)) > 1, f"seed 1234 drew {ours}: at temperature 1 a seeded row must still sample"


def test_bitmask_is_honoured(implementation: Implementation) -> None:
    """With ``allowed_token_bitmask`` a row samples only tokens whose bit is set (bit 31 of a word
    is the int32 sign bit), greedy rows the best of them, random rows in proportion."""
    v = 40
    logits = torch.randn(v).expand(3, v).clone()
    allowed = [set(range(v)), {0, 5, 31, 33, 39}, {31}]
    sampler = implementation.create(v)
    greedy = sample(sampler, logits, temperature=0.0, bitmask=bitmask_of(allowed, v)).token_ids
    for row, tokens in enumerate(allowed):
        best = max(tokens, key=lambda t: float(logits[row, t]))
        assert int(greedy[row]) == best, (
            f"greedy row {row} allowed {sorted(tokens)} must take {best}, got {int(greedy[row])}")
    masked = [{0, 5, 31, 33, 39}] * DRAWS
    drawn = sample(sampler, logits[:1].expand(DRAWS, v), bitmask=bitmask_of(masked, v)).token_ids
    keep = torch.zeros(v, dtype=torch.bool)
    keep[list(masked[0])] = True
    want = torch.where(keep, torch.softmax(logits[0].double(), -1), 0.0)
    assert_frequencies(drawn, want / want.sum(), "rows allowed {0, 5, 31, 33, 39}")


def test_banned_tokens_are_never_sampled(implementation: Implementation) -> None:
    """``banned_token_ids`` (min_tokens keeps stop tokens out) are never sampled in their row."""
    sampler = implementation.create(8)
    banned = [(0, [0]), (1, [0, 1, 2])]
    greedy = sample(sampler, LOGITS.expand(2, 8), temperature=0.0, banned=banned).token_ids
    assert greedy.tolist() == [1, 3], (
        f"greedy rows with tokens [0] and [0, 1, 2] banned must take 1 and 3, got {greedy.tolist()}")
    drawn = sample(sampler, LOGITS.expand(DRAWS, 8), banned=[(row, [0, 1]) for row in range(DRAWS)]).token_ids
    want = expected_probs(LOGITS).clone()
    want[:2] = 0
    assert_frequencies(drawn, want / want.sum(), "rows with tokens 0 and 1 banned")


def test_logprobs_are_of_the_raw_distribution(implementation: Implementation) -> None:
    """Logprobs, ranks and top logprobs are of log_softmax(raw logits), whatever temperature,
    top-k, mask or banned tokens did to the sampling distribution; shapes ``[B]`` and ``[B, K]``."""
    b, v, k = 6, 40, 3
    logits = torch.randn(b, v) * 2
    allowed = [set(range(0, v, 3))] * b
    out = sample(implementation.create(v), logits, temperature=[0.0, 0.5, 1.0, 0.0, 2.0, 1.0], top_k=4,
                 num_logprobs=k, bitmask=bitmask_of(allowed, v), banned=[(2, [0, 3])])
    raw = logits.double().log_softmax(-1)  # [B, V]
    ids = out.token_ids
    for name, shape in (("logprobs", (b,)), ("ranks", (b,)), ("top_ids", (b, k)), ("top_logprobs", (b, k))):
        value = getattr(out, name)
        assert value is not None and tuple(value.shape) == shape, (
            f"with max_num_logprobs={k}, {name} must be {list(shape)}, "
            f"got {None if value is None else tuple(value.shape)}")
    want = raw.gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs.double(), want, atol=1e-4), (
        f"logprobs must be of the raw distribution: want {want.tolist()}, got {out.logprobs.tolist()}")
    ranks = (raw > want[:, None]).sum(-1) + 1
    assert torch.equal(out.ranks.long(), ranks), (
        f"ranks (1 = most likely, raw) must be {ranks.tolist()}, got {out.ranks.tolist()}")
    top, top_ids = raw.topk(k, dim=-1)
    assert torch.equal(out.top_ids.long(), top_ids) and torch.allclose(out.top_logprobs.double(), top, atol=1e-4), (
        f"top logprobs must be the raw top {k}: want ids {top_ids.tolist()}, got {out.top_ids.tolist()}")
