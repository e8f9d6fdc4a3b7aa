"""Speculative verification keeps the target distribution exactly."""

from __future__ import annotations

import torch

from modserve.runner.rejection import verify

# chi-square critical value at p = 0.001; see each test for the degrees of freedom
CHI2_001 = {4: 18.47, 7: 24.32, 15: 37.70}


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = expected_probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_first_token_follows_target_with_disagreeing_draft():
    torch.manual_seed(0)
    V, B = 8, 40000
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5]), 0)
    q = torch.softmax(torch.tensor([-1.0, 0.0, 2.0, 1.0, 1.0, -2.0, 0.0, 0.5]), 0)  # disagrees often
    K = 2
    draft = torch.multinomial(q.expand(B, V), K, replacement=True)  # [B, K] drawn from q
    target = p.expand(B, K + 1, V).contiguous()
    out = verify(target, draft, [K] * B, q.expand(B, K, V).contiguous(), torch.zeros(B, dtype=torch.bool), {})
    first = torch.tensor([t[0] for t in out.token_ids])
    assert chi_square(torch.bincount(first, minlength=V).float(), p) < CHI2_001[7]
    acc = torch.tensor(out.num_accepted, dtype=torch.float)
    # acceptance probability of one draft is sum(min(p, q))
    assert abs((acc >= 1).float().mean() - torch.minimum(p, q).sum()) < 0.01


def test_every_position_follows_target_with_deterministic_draft():
    """n-gram style proposals (q one-hot): position j of the output is distributed as p_j."""
    torch.manual_seed(1)
    V, B, K = 5, 30000, 3
    p = torch.softmax(torch.randn(K + 1, V) * 1.5, dim=1)  # a different target per position
    draft = torch.tensor([[3, 0, 4]]).expand(B, K).contiguous()
    out = verify(p.expand(B, K + 1, V).contiguous(), draft, [K] * B, None, torch.zeros(B, dtype=torch.bool), {})
    # Position 0 is always emitted: ~p_0. Position 1 is emitted after an accept of 3,
    # and then follows p_1 (independent of the past, as p_1 here does not depend on it).
    for j in range(2):
        tokens = torch.tensor([t[j] for t in out.token_ids if len(t) > j])
        assert chi_square(torch.bincount(tokens, minlength=V).float(), p[j]) < CHI2_001[4], j


def test_greedy_accepts_exactly_the_argmax_prefix():
    V = 6
    p = torch.zeros(2, 4, V)
    for j, tok in enumerate([1, 2, 3, 4]):
        p[:, j, tok] = 1.0
    draft = torch.tensor([[1, 2, 5], [1, 2, 3]])
    out = verify(p, draft, [3, 3], None, torch.ones(2, dtype=torch.bool), {})
    assert out.num_accepted == [2, 3]
    assert out.token_ids == [[1, 2, 3], [1, 2, 3, 4]]


def test_fewer_drafts_than_k_and_seeded_rows():
    V = 6
    torch.manual_seed(3)
    p = torch.softmax(torch.randn(2, 4, V), dim=2)
    draft = torch.tensor([[1, 0, 0], [2, 3, 0]])
    gens = {0: torch.Generator().manual_seed(5)}
    a = verify(p, draft, [1, 2], None, torch.zeros(2, dtype=torch.bool), gens)
    gens = {0: torch.Generator().manual_seed(5)}
    b = verify(p, draft, [1, 2], None, torch.zeros(2, dtype=torch.bool), gens)
    assert a.token_ids[0] == b.token_ids[0]
    assert a.num_accepted[0] <= 1 and a.num_accepted[1] <= 2
    assert len(a.token_ids[0]) == a.num_accepted[0] + 1
