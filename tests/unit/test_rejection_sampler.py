"""Rejection sampler: exact token ids on hand-made cases, exactness by simulation."""

from __future__ import annotations

import pytest
import torch

from engine.spec_decode.proposer import Proposal, pack_proposals
from engine.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample

V = 8


def one_hot(token: int, vocab: int = V) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[token] = 1.0
    return row


def dist(weights: dict[int, float], vocab: int = V) -> torch.Tensor:
    row = torch.zeros(vocab)
    for token, w in weights.items():
        row[token] = w
    return row / row.sum()


def run(drafts: list[list[int]], target_rows: list[list[torch.Tensor]], draft_rows=None,
        greedy=None, generators=None, default_generator=None):
    """Build the flat inputs from per-request lists and call the sampler."""
    num_reqs = len(drafts)
    draft_token_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    target_probs = torch.stack([row for rows in target_rows for row in rows])
    draft_probs = None
    if draft_rows is not None:
        draft_probs = torch.stack([row for rows in draft_rows for row in rows]).reshape(-1, V)
    return rejection_sample(
        draft_token_ids, [len(d) for d in drafts], draft_probs, target_probs,
        generators or [None] * num_reqs,
        torch.tensor(greedy or [False] * num_reqs),
        default_generator=default_generator or torch.Generator().manual_seed(0),
    )


def test_all_accepted_emits_bonus():
    # q = p = point mass on each draft: accepted with probability 1; bonus row is a point mass on 7.
    drafts = [[3, 1, 4]]
    targets = [[one_hot(3), one_hot(1), one_hot(4), one_hot(7)]]
    out, num_accepted = run(drafts, targets, draft_rows=[[one_hot(3), one_hot(1), one_hot(4)]])
    assert out.tolist() == [[3, 1, 4, 7]]
    assert num_accepted.tolist() == [3]


def test_first_rejected_emits_recovered_from_residual():
    # p(3) = 0 at position 0: rejected for sure. Residual max(0, p - q) = mass only on token 5.
    p0 = dist({5: 0.5, 2: 0.5})
    q0 = dist({3: 0.5, 2: 0.5})
    drafts = [[3, 1]]
    targets = [[p0, one_hot(1), one_hot(6)]]
    out, num_accepted = run(drafts, targets, draft_rows=[[q0, one_hot(1)]])
    assert out.tolist() == [[5, PLACEHOLDER, PLACEHOLDER]]
    assert num_accepted.tolist() == [0]


def test_mixed_k_in_one_batch_including_zero():
    drafts = [[2, 2], [], [1, 6, 0]]
    targets = [
        [one_hot(2), one_hot(2), one_hot(5)],  # both accepted, bonus 5
        [one_hot(4)],  # k = 0: just the bonus from its single row
        [one_hot(1), dist({3: 1.0}), one_hot(0), one_hot(7)],  # draft 6 has p = 0: recovered 3
    ]
    out, num_accepted = run(drafts, targets)  # point-mass q (n-gram style)
    assert out.tolist() == [
        [2, 2, 5, PLACEHOLDER],
        [4, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER],
        [1, 3, PLACEHOLDER, PLACEHOLDER],
    ]
    assert num_accepted.tolist() == [2, 0, 1]


def test_all_requests_k_zero():
    out, num_accepted = run([[], []], [[one_hot(2)], [one_hot(6)]])
    assert out.tolist() == [[2], [6]]
    assert num_accepted.tolist() == [0, 0]


def test_q_zero_where_p_has_mass():
    # Dense q concentrated on token 1; p also puts mass on 2, which q never proposes.
    p = dist({1: 0.5, 2: 0.5})
    q = one_hot(1)
    n = 20_000
    out, num_accepted = run([[1]] * n, [[p, one_hot(0)]] * n, draft_rows=[[q]] * n)
    # Accepted with p(1)/q(1) = 0.5 (then bonus 0); otherwise recovered from max(0, p - q) = {2}.
    first = out[:, 0]
    assert set(first.tolist()) == {1, 2}
    assert torch.equal(out[first == 1, 1], torch.zeros(int((first == 1).sum()), dtype=torch.int64))
    assert torch.all(out[first == 2, 1] == PLACEHOLDER)
    assert abs((first == 1).float().mean().item() - 0.5) < 0.02


def test_draft_with_q_zero_is_accepted_when_p_positive():
    # An inconsistent proposer drafted a token its own q gives 0: p/q = inf, accept.
    out, _ = run([[2]], [[dist({2: 0.1, 3: 0.9}), one_hot(5)]], draft_rows=[[one_hot(3)]])
    assert out.tolist() == [[2, 5]]


def test_vanishing_residual_falls_back_to_p():
    # q(3) = 4 > p(3) = 1 (q not normalised): accepted w.p. 1/4; on rejection max(0, p - q) = 0
    # everywhere, so the recovered token must come from p itself, i.e. be 3.
    q = one_hot(3) * 4.0
    n = 1000
    out, num_accepted = run([[3]] * n, [[one_hot(3), one_hot(6)]] * n, draft_rows=[[q]] * n)
    assert torch.all(out[:, 0] == 3)
    assert 0 < int((num_accepted == 0).sum()) < n


def test_greedy_is_argmax_match():
    p_a = dist({1: 0.4, 2: 0.3, 3: 0.3})  # argmax 1
    p_b = dist({4: 0.6, 5: 0.4})  # argmax 4
    drafts = [[1, 5], [1, 4], [2]]
    targets = [[p_a, p_b, one_hot(0)], [p_a, p_b, dist({6: 0.9, 7: 0.1})], [one_hot(2), one_hot(5)]]
    # Draft probabilities are irrelevant for greedy: q(1) = 1 would accept with p/q = 0.4 only.
    # The third request samples (point masses) in the same batch.
    out, num_accepted = run(drafts, targets, greedy=[True, True, False])
    assert out.tolist() == [[1, 4, PLACEHOLDER], [1, 4, 6], [2, 5, PLACEHOLDER]]
    assert num_accepted.tolist() == [1, 2, 1]
    # Next to a greedy request, sampled requests still sample: a 50/50 bonus row gives both tokens.
    n = 200
    out, _ = run([[1]] + [[2]] * n, [[p_a, one_hot(0)]] + [[one_hot(2), dist({5: 1, 6: 1})]] * n,
                 greedy=[True] + [False] * n)
    assert out[0].tolist() == [1, 0]
    assert set(out[1:, 1].tolist()) == {5, 6}


def test_greedy_ignores_its_generator():
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    run([[1]], [[dist({1: 0.4, 2: 0.6}), one_hot(0)]], greedy=[True], generators=[g])
    assert torch.equal(g.get_state(), state)


def _random_probs(gen: torch.Generator, rows: int) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, V, generator=gen) * 2.0, dim=-1)


def test_seeded_request_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(11)
    k = 4
    target = torch.softmax(torch.randn(k + 1, V, generator=gen) * 0.5, dim=-1)  # flat: outcomes vary
    draft = torch.softmax(torch.randn(k, V, generator=gen) * 0.5, dim=-1)
    drafts = torch.multinomial(draft, 1, generator=gen).squeeze(1).tolist()

    def seeded_row(seed: int, batch_before: int, batch_after: int) -> list[int]:
        """Output of the seeded request placed among other requests (own, shared or greedy RNG)."""
        others_before = [([0, 1, 2][:i % 3], i) for i in range(batch_before)]
        others_after = [([3][:i % 2], i) for i in range(batch_after)]
        all_drafts, all_targets, all_q, gens, greedy = [], [], [], [], []
        for d, i in others_before + [(drafts, -1)] + others_after:
            all_drafts.append(d)
            if i == -1:
                all_targets.append(list(target))
                all_q.append(list(draft))
                gens.append(torch.Generator().manual_seed(seed))
                greedy.append(False)
            else:
                all_targets.append(list(_random_probs(gen, len(d) + 1)))
                all_q.append(list(_random_probs(gen, len(d))))
                gens.append(torch.Generator().manual_seed(1000 + i) if i % 2 else None)
                greedy.append(i % 4 == 3)
        out, _ = run(all_drafts, all_targets, draft_rows=all_q, greedy=greedy, generators=gens,
                     default_generator=torch.Generator().manual_seed(batch_before + batch_after))
        return out[batch_before, :k + 1].tolist()

    outcomes = set()
    for seed in range(8):
        alone = seeded_row(seed, 0, 0)
        outcomes.add(tuple(alone))
        assert seeded_row(seed, 3, 0) == alone
        assert seeded_row(seed, 0, 5) == alone
        assert seeded_row(seed, 7, 2) == alone
    assert len(outcomes) > 4  # the seed, not the batch, decides the outcome


# Exactness by simulation: large batches of independent requests, fixed seeds.

N = 100_000
K = 3


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def histogram(tokens: torch.Tensor, vocab: int = V) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def _fixed_context_case(gen: torch.Generator, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    p = torch.softmax(torch.randn(V, generator=gen) * 1.5, dim=-1)
    if kind == "dense":
        q = torch.softmax(torch.randn(V, generator=gen) * 1.5, dim=-1)
    elif kind == "q_zeros":  # q puts no mass on half of p's support
        q = torch.softmax(torch.randn(V, generator=gen), dim=-1)
        q[: V // 2] = 0.0
        q = q / q.sum()
    else:  # point mass
        q = None
    return p, q


@pytest.mark.parametrize("kind", ["dense", "q_zeros", "point_mass"])
def test_exact_with_fixed_context(kind):
    """p, q do not depend on history: every emitted position is p-distributed, acceptance is alpha."""
    gen = torch.Generator().manual_seed({"dense": 1, "q_zeros": 2, "point_mass": 3}[kind])
    p, q = _fixed_context_case(gen, kind)
    if q is None:  # a deterministic proposer always drafting token d (q = point mass on d)
        d = int(p.argmax())
        draft_token_ids = torch.full((N * K,), d, dtype=torch.int64)
        draft_probs = None
        alpha = p[d].item()
    else:
        draft_token_ids = torch.multinomial(q, N * K, replacement=True, generator=gen)
        draft_probs = q.expand(N * K, V).contiguous()
        alpha = torch.minimum(p, q).sum().item()
    target_probs = p.expand(N * (K + 1), V).contiguous()
    out, num_accepted = rejection_sample(
        draft_token_ids, [K] * N, draft_probs, target_probs, [None] * N,
        torch.zeros(N, dtype=torch.bool), default_generator=torch.Generator().manual_seed(99))

    p64 = p.double()
    assert tv(histogram(out[:, 0]), p64) < 0.01
    for j in (1, 2, 3):  # position j, given the call emitted it, is p-distributed too
        emitted = out[num_accepted >= j, j]
        assert tv(histogram(emitted), p64) < 0.01 + 0.5 * (V / emitted.numel()) ** 0.5
    # Per-draft acceptance: P(accept draft j | drafts < j accepted) = alpha for every j.
    for j in range(K):
        reached = int((num_accepted >= j).sum())
        accepted = int((num_accepted >= j + 1).sum())
        assert abs(accepted / reached - alpha) < 0.01
    assert abs(num_accepted.double().mean().item() - sum(alpha ** j for j in range(1, K + 1))) < 0.02
    assert torch.all((out >= 0).sum(dim=1) == num_accepted + 1)


def test_k_zero_samples_bonus_from_p():
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(V, generator=gen), dim=-1)
    out, num_accepted = rejection_sample(
        torch.empty(0, dtype=torch.int64), [0] * N, None, p.expand(N, V).contiguous(), [None] * N,
        torch.zeros(N, dtype=torch.bool), default_generator=torch.Generator().manual_seed(6))
    assert out.shape == (N, 1)
    assert tv(histogram(out[:, 0]), p.double()) < 0.01
    assert torch.all(num_accepted == 0)


def test_exact_stream_with_history_dependent_model():
    """A Markov target P[prev] and draft Q[prev]: the generated stream's joint law must be P's.

    Runs an engine-like loop (draft a chain of K from Q, verify, append the emitted tokens) for
    a large batch of independent requests, then compares the first three tokens of the stream
    with exact ancestral sampling from P.
    """
    n = 200_000
    gen = torch.Generator().manual_seed(21)
    target_table = torch.softmax(torch.randn(V, V, generator=gen) * 1.5, dim=-1)  # [prev, next]
    draft_table = torch.softmax(torch.randn(V, V, generator=gen) * 1.5, dim=-1)
    draft_table[:, 0] = 0.0  # the draft can never propose token 0; the target can
    draft_table = draft_table / draft_table.sum(-1, keepdim=True)
    draft_cdf = draft_table.cumsum(-1)
    rng = torch.Generator().manual_seed(22)

    last = torch.zeros(n, dtype=torch.int64)  # every stream starts after token 0
    streams = torch.full((n, 3 * (K + 1)), PLACEHOLDER, dtype=torch.int64)
    lengths = torch.zeros(n, dtype=torch.int64)
    for _ in range(3):  # each step emits >= 1 token, so 3 steps give >= 3 tokens per stream
        chain_prev = [last]
        drafts = []
        for _j in range(K):  # inverse-CDF draw from Q[prev] (right=True skips zero-mass tokens)
            u = torch.rand(n, 1, generator=rng)
            d = torch.searchsorted(draft_cdf[chain_prev[-1]], u, right=True).squeeze(1).clamp_(max=V - 1)
            drafts.append(d)
            chain_prev.append(d)
        prev = torch.stack(chain_prev, dim=1)  # [n, K + 1]: context token of each row
        draft_ids = torch.stack(drafts, dim=1)  # [n, K]
        out, num_accepted = rejection_sample(
            draft_ids.reshape(-1), [K] * n, draft_table[prev[:, :K]].reshape(-1, V),
            target_table[prev].reshape(-1, V), [None] * n, torch.zeros(n, dtype=torch.bool),
            default_generator=rng)
        cols = torch.arange(K + 1)
        is_emitted = cols < (num_accepted + 1).unsqueeze(1)  # [n, K + 1]
        rows, pos = is_emitted.nonzero(as_tuple=True)
        streams[rows, lengths[rows] + pos] = out[rows, pos]
        lengths += num_accepted + 1
        last = out[torch.arange(n), num_accepted]

    first, second, third = streams[:, 0], streams[:, 1], streams[:, 2]
    p0 = target_table[0].double()
    joint01 = p0.unsqueeze(1) * target_table.double()  # [V, V] exact law of (t0, t1)
    p1 = joint01.sum(0)
    p2 = p1 @ target_table.double()
    assert tv(histogram(first), p0) < 0.01
    assert tv(histogram(second), p1) < 0.01
    assert tv(histogram(third), p2) < 0.01
    measured01 = histogram(first * V + second, V * V).reshape(V, V)
    assert tv(measured01, joint01) < 0.02
    # Conditional law of t1 given t0 for the likeliest t0: a sharper check of the chaining.
    t0 = int(p0.argmax())
    assert tv(histogram(second[first == t0]), target_table[t0].double()) < 0.015


def test_pack_proposals_mixes_point_mass_and_dense():
    q = torch.full((2, V), 1.0 / V)
    draft_ids, num_draft, draft_probs = pack_proposals(
        [Proposal([3]), Proposal([]), Proposal([1, 2], q)], vocab_size=V)
    assert draft_ids.tolist() == [3, 1, 2]
    assert num_draft == [1, 0, 2]
    assert torch.equal(draft_probs[0], one_hot(3))
    assert torch.equal(draft_probs[1:], q)
    assert pack_proposals([Proposal([4])], vocab_size=V)[2] is None


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_sample(torch.tensor([1]), [1], None, torch.zeros(1, V), [None], [False])
    with pytest.raises(ValueError, match="draft_token_ids must be"):
        rejection_sample(torch.tensor([1, 2]), [1], None, torch.zeros(2, V), [None], [False])
    with pytest.raises(ValueError, match="float32"):
        rejection_sample(torch.tensor([1]), [1], None, torch.zeros(2, V, dtype=torch.float64),
                         [None], [False])
