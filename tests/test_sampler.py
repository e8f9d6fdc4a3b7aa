"""Tests of the built-in sampler (modserve.samplers.default)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from modserve.core.contracts.sampler import SamplingBatch
from modserve.samplers.default import DefaultSampler, apply_penalties


def _per_row(value, B: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * B


def _pad(rows: list[list[int]] | None, pad: int) -> torch.Tensor | None:
    if rows is None:
        return None
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


def make_batch(
    B: int,
    V: int,
    *,
    temperature=1.0,
    top_k=-1,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    seeds: dict[int, int] | None = None,
    prompt: list[list[int]] | None = None,
    output: list[list[int]] | None = None,
    banned: list[tuple[int, list[int]]] | None = None,
    max_num_logprobs: int = -1,
) -> SamplingBatch:
    """A SamplingBatch from scalars (same for every row) or per-row lists; flags derived."""
    temp, tk, tp, mp = (_per_row(v, B) for v in (temperature, top_k, top_p, min_p))
    rep, pres, freq = (_per_row(v, B) for v in (repetition_penalty, presence_penalty, frequency_penalty))
    any_penalty = any(r != 1.0 for r in rep) or any(p != 0.0 for p in pres) or any(f != 0.0 for f in freq)
    if any_penalty:  # the engine sends token ids only when some row has a penalty
        prompt = prompt if prompt is not None else [[] for _ in range(B)]
        output = output if output is not None else [[] for _ in range(B)]
    return SamplingBatch(
        temperature=torch.tensor(temp, dtype=torch.float32),
        top_k=torch.tensor(tk, dtype=torch.int64),
        top_p=torch.tensor(tp, dtype=torch.float32),
        min_p=torch.tensor(mp, dtype=torch.float32),
        repetition_penalty=torch.tensor(rep, dtype=torch.float32),
        presence_penalty=torch.tensor(pres, dtype=torch.float32),
        frequency_penalty=torch.tensor(freq, dtype=torch.float32),
        all_greedy=all(t == 0.0 for t in temp),
        any_top_k=any(k > 0 for k in tk),
        any_top_p=any(p < 1.0 for p in tp),
        any_min_p=any(m > 0.0 for m in mp),
        any_penalty=any_penalty,
        generators={row: torch.Generator().manual_seed(s) for row, s in (seeds or {}).items()},
        prompt_token_ids=_pad(prompt, V) if any_penalty else None,
        output_token_ids=_pad(output, V) if any_penalty else None,
        banned_token_ids=list(banned or []),
        max_num_logprobs=max_num_logprobs,
    )


# ---------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------
def test_greedy_is_argmax_and_leaves_input_alone():
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    before = logits.clone()
    out = DefaultSampler(100)(logits, make_batch(16, 100, temperature=0.0))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.ranks is None and out.top_ids is None
    assert torch.equal(logits, before)  # banned/penalties must not write into the caller's tensor


def test_greedy_rows_in_mixed_batch_ignore_filters():
    torch.manual_seed(1)
    B, V = 32, 64
    logits = torch.randn(B, V)
    temp = [0.0 if i % 2 == 0 else 1.0 for i in range(B)]
    # Filters on greedy rows that would exclude nothing relevant, but must not change argmax.
    out = DefaultSampler(V)(logits, make_batch(B, V, temperature=temp, top_k=5, top_p=0.5, min_p=0.3))
    greedy_rows = torch.arange(0, B, 2)
    assert torch.equal(out.token_ids[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_top_k_1_equals_greedy_at_any_temperature():
    torch.manual_seed(2)
    B, V = 64, 200
    logits = torch.randn(B, V) * 3
    temp = (torch.rand(B) * 2 + 0.1).tolist()
    for _ in range(3):
        out = DefaultSampler(V)(logits, make_batch(B, V, temperature=temp, top_k=1))
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_bf16_logits_are_accepted():
    torch.manual_seed(3)
    logits = torch.randn(4, 50).to(torch.bfloat16)
    out = DefaultSampler(50)(logits, make_batch(4, 50, temperature=0.0, max_num_logprobs=2))
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs.dtype == torch.float32


# ---------------------------------------------------------------------------
# Seeded rows
# ---------------------------------------------------------------------------
def _seeded_run(seed: int, batch_size: int, position: int, steps: int = 12) -> list[int]:
    """Tokens of one seeded row over ``steps`` steps, inside a batch of other random rows."""
    V = 50
    sampler = DefaultSampler(V)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.Generator().manual_seed(1000 + batch_size * 31 + position)  # differs per layout
    tokens = []
    for step in range(steps):
        # The seeded row's logits are the same in every layout; the others are not.
        row_logits = torch.randn(V, generator=torch.Generator().manual_seed(step)) * 0.5
        logits = torch.randn(batch_size, V, generator=noise) * 2
        logits[position] = row_logits
        temp = (torch.rand(batch_size, generator=noise) + 0.2).tolist()
        temp[position] = 1.3
        top_k = [int(k) for k in torch.randint(-1, 20, (batch_size,), generator=noise)]
        top_k[position] = 40
        top_p = [0.9] * batch_size
        top_p[position] = 0.95
        batch = make_batch(batch_size, V, temperature=temp, top_k=top_k, top_p=top_p)
        # Other rows are seeded too (differently) or not; their generators must not interfere.
        for other in range(0, batch_size, 3):
            if other != position:
                batch.generators[other] = torch.Generator().manual_seed(other + 77 * step)
        batch.generators[position] = gen
        torch.manual_seed(step * 13 + batch_size)  # global RNG state differs per layout too
        tokens.append(int(sampler(logits, batch).token_ids[position]))
    return tokens


def test_seeded_row_is_reproducible_whatever_the_batch():
    alone = _seeded_run(seed=1234, batch_size=1, position=0)
    assert len(set(alone)) > 3  # really sampled, not a constant argmax
    for batch_size, position in [(1, 0), (4, 3), (7, 2), (16, 0), (33, 32)]:
        assert _seeded_run(seed=1234, batch_size=batch_size, position=position) == alone
    assert _seeded_run(seed=4321, batch_size=4, position=1) != alone


def test_unseeded_rows_follow_global_rng():
    torch.manual_seed(5)
    logits = torch.randn(8, 50)
    batch = make_batch(8, 50)
    torch.manual_seed(42)
    a = DefaultSampler(50)(logits, batch).token_ids
    torch.manual_seed(42)
    b = DefaultSampler(50)(logits, batch).token_ids
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# Distributions (chi-square against the exact expected distribution)
# ---------------------------------------------------------------------------
# Fixed logits, deliberately not sorted by id, so the filters must map sorted
# positions back to token ids. Sorted descending: ids 2, 4, 6, 0, 3, 7, 1, 5.
FIXED_LOGITS = [0.5, -1.0, 2.0, 0.0, 1.5, -2.0, 1.0, -0.5]
N_SAMPLES = 20000
# Chi-square critical values at p = 0.001 by degrees of freedom (standard tables;
# scipy.stats.chi2.ppf(0.999, df)). A correct sampler exceeds them once in 1000 seeds.
CHI2_CRIT_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def _expected(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> list[float]:
    """Reference distribution in float64 plain Python, written independently of the sampler."""
    scaled = [x / temperature for x in FIXED_LOGITS]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k] if top_k > 0 else order)

    def normalised(ids):
        z = sum(math.exp(scaled[i]) for i in ids)
        return {i: math.exp(scaled[i]) / z for i in ids}

    if top_p < 1.0:
        probs, mass, nucleus = normalised(keep), 0.0, set()
        for i in (i for i in order if i in keep):
            if mass >= top_p:  # the tokens already kept reach top_p
                break
            nucleus.add(i)
            mass += probs[i]
        keep = nucleus
    if min_p > 0.0:
        probs = normalised(keep)
        top = max(probs.values())
        keep = {i for i in keep if probs[i] >= min_p * top}
    probs = normalised(keep)
    return [probs.get(i, 0.0) for i in range(len(scaled))]


@pytest.mark.parametrize(
    "params, num_kept",
    [
        (dict(temperature=0.7), 8),
        (dict(top_p=0.8), 4),  # cumulative 0.403, 0.647, 0.795 < 0.8 -> a 4th token is needed
        (dict(min_p=0.2), 4),  # prob ratios to top: 1, .61, .37, .22, .14 ...
        (dict(top_k=3), 3),
        (dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1), 3),
    ],
    ids=["temperature", "top_p", "min_p", "top_k", "combined"],
)
def test_sampled_distribution_matches_expected(params, num_kept):
    V = len(FIXED_LOGITS)
    expected = _expected(**params)
    assert sum(p > 0 for p in expected) == num_kept  # the case really exercises the filter
    logits = torch.tensor(FIXED_LOGITS).expand(N_SAMPLES, V).contiguous()
    torch.manual_seed(2024)
    tokens = DefaultSampler(V)(logits, make_batch(N_SAMPLES, V, **params)).token_ids
    counts = torch.bincount(tokens, minlength=V).tolist()

    allowed = {i for i, p in enumerate(expected) if p > 0}
    assert all(counts[i] == 0 for i in range(V) if i not in allowed), counts
    chi2 = sum((counts[i] - N_SAMPLES * expected[i]) ** 2 / (N_SAMPLES * expected[i]) for i in allowed)
    assert chi2 < CHI2_CRIT_P001[len(allowed) - 1], (chi2, counts, expected)


def test_seeded_rows_sample_the_right_distribution():
    # Every row with its own generator: the per-row path must also be a correct sampler.
    V, B = len(FIXED_LOGITS), 4000
    logits = torch.tensor(FIXED_LOGITS).expand(B, V).contiguous()
    batch = make_batch(B, V, temperature=0.7, seeds={row: 10_000 + row for row in range(B)})
    tokens = DefaultSampler(V)(logits, batch).token_ids
    counts = torch.bincount(tokens, minlength=V).tolist()
    expected = _expected(temperature=0.7)
    chi2 = sum((counts[i] - B * expected[i]) ** 2 / (B * expected[i]) for i in range(V))
    assert chi2 < CHI2_CRIT_P001[V - 1], (chi2, counts)


# ---------------------------------------------------------------------------
# Penalties and banned tokens
# ---------------------------------------------------------------------------
def test_repetition_penalty_hf_style_over_prompt_and_output():
    V = 6
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5, 1.0]])
    # Token 0 in the prompt, token 1 in the output, token 4 in both; 2, 3, 5 unseen.
    batch = make_batch(1, V, repetition_penalty=2.0, prompt=[[0, 4]], output=[[1, 4, 4]])
    got = apply_penalties(logits.clone(), batch, V)
    assert torch.allclose(got, torch.tensor([[1.0, -2.0, 3.0, -2.0, 0.25, 1.0]]))


def test_repetition_penalty_changes_greedy_choice():
    V = 4
    logits = torch.tensor([[3.0, 2.0, -1.0, -1.5], [-1.0, -1.5, -3.0, -4.0]])
    sampler = DefaultSampler(V)
    # Row 0: 3.0/2 = 1.5 < 2.0; row 1: -1.0*2 = -2.0 < -1.5. Both flip to token 1.
    batch = make_batch(2, V, temperature=0.0, repetition_penalty=2.0, prompt=[[0], []], output=[[], [0]])
    assert sampler(logits, batch).token_ids.tolist() == [1, 1]
    # 3.0/1.4 = 2.14 > 2.0 and -1.4 > -1.5: the penalty is not strong enough to flip.
    batch = make_batch(2, V, temperature=0.0, repetition_penalty=1.4, prompt=[[0], []], output=[[], [0]])
    assert sampler(logits, batch).token_ids.tolist() == [0, 0]


def test_presence_and_frequency_apply_to_output_tokens_only():
    V = 6
    logits = torch.zeros(2, V)
    batch = make_batch(
        2, V,
        presence_penalty=[0.5, 0.0],
        frequency_penalty=[0.25, -0.5],
        prompt=[[2, 2, 2], [3]],  # prompt tokens: no presence/frequency penalty
        output=[[1, 1, 1, 4], [5]],  # row 1 padded to width 4 with V
    )
    got = apply_penalties(logits.clone(), batch, V)
    want = torch.tensor(
        [
            [0.0, -(0.5 + 3 * 0.25), 0.0, 0.0, -(0.5 + 0.25), 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.5],
        ]
    )
    assert torch.allclose(got, want)


def test_penalty_rows_without_penalty_are_unchanged():
    torch.manual_seed(6)
    V = 30
    logits = torch.randn(3, V)
    batch = make_batch(
        3, V, repetition_penalty=[1.0, 1.3, 1.0], frequency_penalty=[0.0, 0.0, 0.0],
        prompt=[[1, 2, 3], [1, 2, 3], [V - 1]], output=[[4, 5], [4, 5], []],
    )
    got = apply_penalties(logits.clone(), batch, V)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    seen = [1, 2, 3, 4, 5]
    assert not torch.allclose(got[1, seen], logits[1, seen])
    unseen = [i for i in range(V) if i not in seen]
    assert torch.equal(got[1, unseen], logits[1, unseen])


def test_banned_tokens_are_never_sampled():
    V, B = 8, 20000
    logits = torch.tensor(FIXED_LOGITS).expand(B, V).contiguous()
    # Ban the two likeliest tokens (ids 2 and 4) in every other row.
    banned = [(row, [2, 4]) for row in range(0, B, 2)]
    torch.manual_seed(7)
    tokens = DefaultSampler(V)(logits, make_batch(B, V, banned=banned)).token_ids
    assert not torch.isin(tokens[0::2], torch.tensor([2, 4])).any()
    assert torch.isin(tokens[1::2], torch.tensor([2, 4])).any()  # still sampled where allowed
    greedy = DefaultSampler(V)(logits[:2], make_batch(2, V, temperature=0.0, banned=[(0, [2])]))
    assert greedy.token_ids.tolist() == [4, 2]


# ---------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------
def test_logprobs_are_of_raw_logits():
    torch.manual_seed(8)
    B, V, K = 24, 100, 5
    logits = torch.randn(B, V) * 2
    temp = [0.0 if i % 3 == 0 else 0.8 for i in range(B)]
    batch = make_batch(
        B, V, temperature=temp, top_k=10, repetition_penalty=1.5,
        prompt=[[int(logits[i].argmax())] for i in range(B)],  # penalise the raw argmax
        banned=[(1, [int(logits[1].argmax())])],
        max_num_logprobs=K,
    )
    out = DefaultSampler(V)(logits, batch)
    raw = torch.log_softmax(logits.double(), -1)
    tokens = out.token_ids
    assert torch.allclose(out.logprobs.double(), raw.gather(1, tokens[:, None]).squeeze(1), atol=1e-5)
    # Rank = 1 + number of tokens strictly more likely, by the raw distribution.
    order = raw.argsort(dim=-1, descending=True)
    want_ranks = (order == tokens[:, None]).float().argmax(-1) + 1
    assert torch.equal(out.ranks, want_ranks)
    assert (out.ranks[1] > 1).item()  # banned raw argmax: the token is not rank 1
    # Top logprobs: K most likely by the raw distribution, sorted descending.
    assert out.top_ids.shape == (B, K) and out.top_logprobs.shape == (B, K)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.equal(out.top_ids, order[:, :K])
    assert torch.allclose(out.top_logprobs.double(), raw.gather(1, order[:, :K]), atol=1e-5)


def test_logprobs_zero_gives_sampled_only():
    torch.manual_seed(9)
    logits = torch.randn(4, 20)
    out = DefaultSampler(20)(logits, make_batch(4, 20, temperature=0.0, max_num_logprobs=0))
    assert torch.equal(out.ranks, torch.ones(4, dtype=torch.int64))
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).max(-1).values)
    assert out.top_ids is None and out.top_logprobs is None


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------
def test_registered_as_default_without_importing_torch_code():
    from modserve.core.registry import Registry
    import modserve.samplers as plugin

    reg = Registry()
    reg.add_plugin(plugin, "samplers")
    assert reg.names("sampler") == ["default"]
    assert reg.load("sampler", "default") is DefaultSampler
    # Registration itself must not import the implementation (nor torch).
    code = (
        "import sys, modserve.samplers as p\n"
        "p.register_samplers(register=lambda *a, **k: None)\n"
        "assert 'modserve.samplers.default' not in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_row_argmax_is_torchs_argmax_on_ties_nan_and_infinities():
    """The greedy argmax (numpy's on float32 CPU logits) picks what torch.argmax picks."""
    from modserve.samplers.default import row_argmax

    nan, inf = float("nan"), float("inf")
    edge = torch.tensor([[1.0, 3.0, 3.0, 0.0], [nan, 1.0, nan, 5.0], [-inf] * 4, [2.0, inf, inf, 1.0],
                         [0.0, 0.0, nan, 9.0], [-1.0, -1.0, -1.0, -1.0]])
    rand = torch.randn(16, 4096, generator=torch.Generator().manual_seed(0))
    rand[3, 100] = rand[3, 7] = rand[3].max() + 1  # a tie at the maximum
    for logits in (edge, rand, rand[:, ::2], rand[:0], rand.bfloat16()):
        got = row_argmax(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1)), logits.dtype
