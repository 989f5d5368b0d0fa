"""Sampler, processors, metadata and logprobs: exact values and sampled distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.sampling.logprobs import compute_prompt_logprobs
from engine.sampling.metadata import SamplingMetadata, make_generator
from engine.sampling.processors import apply_penalties, process_logits
from engine.sampling.sampler import Sampler, compute_probs, sample_from_probs
from engine.sampling_params import SamplingParams

# Probabilities of a V=8 vocabulary, deliberately not in token order.
PROBS = np.array([0.15, 0.4, 0.03, 0.25, 0.005, 0.1, 0.015, 0.05])
LOGITS = torch.tensor(np.log(PROBS), dtype=torch.float32)
NUM_SAMPLES = 50_000


def metadata(params, outputs=None, prompts=None, generators=None, vocab_size=8, **kwargs):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingMetadata.from_requests(params, outputs, prompts, generators, vocab_size,
                                          "cpu", **kwargs)


def empirical(params: SamplingParams, num: int = NUM_SAMPLES, seed: int = 0) -> np.ndarray:
    sampler = Sampler(torch.Generator().manual_seed(seed))
    out = sampler(LOGITS.expand(num, -1), metadata([params] * num))
    return np.bincount(out.sampled_token_ids.numpy(), minlength=8) / num


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


def expected(kept: dict[int, float]) -> np.ndarray:
    dist = np.zeros(8)
    for token, weight in kept.items():
        dist[token] = weight
    return dist / dist.sum()


def reference(probs: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Plain-loop reference: temperature, then top-k, top-p (on the renormalised top-k
    distribution), min-p."""
    p = np.exp(np.log(probs) / temperature)
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    mass = sum(p[i] for i in keep)
    kept_p, cumulative = set(), 0.0
    for i in order:
        if i in keep and cumulative < top_p:
            kept_p.add(i)
            cumulative += p[i] / mass
    best = max(p)
    final = {i: p[i] for i in kept_p if p[i] >= min_p * best}
    return expected(final)


# ---- distributions ---------------------------------------------------------------------


def test_plain_sampling_matches_softmax():
    assert total_variation(empirical(SamplingParams()), PROBS) < 0.01


@pytest.mark.parametrize("params,dist", [
    # top-k 3 keeps 0.4, 0.25, 0.15.
    (SamplingParams(top_k=3), expected({1: 0.4, 3: 0.25, 0: 0.15})),
    # top-p 0.6: 0.4 alone is < 0.6, 0.4 + 0.25 reaches it.
    (SamplingParams(top_p=0.6), expected({1: 0.4, 3: 0.25})),
    # min-p 0.3: threshold 0.3 * 0.4 = 0.12 keeps 0.4, 0.25, 0.15.
    (SamplingParams(min_p=0.3), expected({1: 0.4, 3: 0.25, 0: 0.15})),
    # temperature 0.5 squares the probabilities.
    (SamplingParams(temperature=0.5), PROBS**2 / (PROBS**2).sum()),
], ids=["top_k", "top_p", "min_p", "temperature"])
def test_truncation_and_temperature_sample_the_intended_distribution(params, dist):
    sample = empirical(params)
    assert total_variation(sample, dist) < 0.01
    assert np.all(sample[dist == 0] == 0)  # truncated tokens are never drawn


def test_combined_processors_follow_the_documented_order():
    # top-p is computed on the renormalised temperature-2, top-k-6 distribution: it keeps 4
    # tokens there, but would keep 5 without top-k.
    params = SamplingParams(temperature=2.0, top_k=6, top_p=0.8, min_p=0.3)
    dist = reference(PROBS, temperature=2.0, top_k=6, top_p=0.8, min_p=0.3)
    assert np.count_nonzero(dist) == 4
    assert np.count_nonzero(reference(PROBS, temperature=2.0, top_p=0.8)) == 5
    assert total_variation(empirical(params), dist) < 0.01


def test_min_p_applies_after_temperature():
    # Temperature 2 takes square roots: 0.15 is sqrt(0.375) = 0.61 of the top token, kept at
    # min_p 0.55; at temperature 1 it is 0.375 of it, dropped.
    params = SamplingParams(temperature=2.0, min_p=0.55)
    dist = expected({1: 0.4**0.5, 3: 0.25**0.5, 0: 0.15**0.5})
    assert total_variation(empirical(params), dist) < 0.01
    assert np.count_nonzero(reference(PROBS, min_p=0.55)) == 2


def test_seeded_rows_sample_the_intended_distribution():
    num = 20_000
    params = [SamplingParams(top_k=3, seed=seed) for seed in range(num)]
    out = Sampler()(LOGITS.expand(num, -1), metadata(params))
    sample = np.bincount(out.sampled_token_ids.numpy(), minlength=8) / num
    assert total_variation(sample, expected({1: 0.4, 3: 0.25, 0: 0.15})) < 0.015


def test_sample_from_probs_with_zeros_never_picks_them():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(10_000, -1).contiguous()
    meta = metadata([SamplingParams()] * 10_000, vocab_size=4)
    tokens = sample_from_probs(probs, meta, torch.Generator().manual_seed(1))
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[0] == counts[2] == 0 and abs(counts[1] - 5000) < 250


# ---- greedy, seeds -----------------------------------------------------------------------


def test_greedy_is_argmax_in_mixed_batches():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0),
              SamplingParams(top_k=5, temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.0, top_p=0.1)]
    out = Sampler()(logits, metadata(params, vocab_size=50))
    greedy_rows = [0, 2, 3, 5]
    assert out.sampled_token_ids[greedy_rows].tolist() == logits[greedy_rows].argmax(-1).tolist()
    all_greedy = Sampler()(logits, metadata([SamplingParams(temperature=0)] * 6, vocab_size=50))
    assert all_greedy.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert all_greedy.sampled_token_ids.dtype == torch.int64


def generate(params: SamplingParams, others: list[SamplingParams], steps: int = 8,
             vocab_size: int = 1000, keep_generator: bool = True) -> list[int]:
    """Sample ``steps`` tokens for ``params`` in row min(3, len(others)) of a batch."""
    logits_gen = torch.Generator().manual_seed(42)  # the 'model': fixed logits per step
    rows = others[:3] + [params] + others[3:]
    outputs: list[list[int]] = [[] for _ in rows]
    generators = [make_generator(p.seed) if p.seed is not None else None for p in rows]
    sampler = Sampler(torch.Generator().manual_seed(len(rows)))
    for _ in range(steps):
        step_logits = torch.randn(vocab_size, generator=logits_gen) * 2
        logits = step_logits.expand(len(rows), -1).contiguous()
        gens = generators if keep_generator else None
        meta = metadata(rows, outputs, generators=gens, vocab_size=vocab_size)
        for row, token in enumerate(sampler(logits, meta).sampled_token_ids.tolist()):
            outputs[row].append(token)
    return outputs[min(3, len(others))]


OTHERS = [SamplingParams(seed=100 + i, temperature=0.5 + 0.1 * i) if i % 3 else
          SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=10)
          for i in range(15)]


def test_seeded_request_is_independent_of_its_batch():
    params = SamplingParams(seed=1234, top_p=0.95, repetition_penalty=1.2)
    alone = generate(params, [])
    assert generate(params, OTHERS) == alone  # 16 rows
    assert generate(params, OTHERS[::-1][:7]) == alone
    assert generate(params, OTHERS, keep_generator=False) == alone  # fresh generators
    assert generate(params.replace(seed=1235), OTHERS) != alone
    assert len(set(alone)) > 3  # really random


def test_seed_depends_on_position_not_on_history_of_draws():
    # A decode worker that starts at output position 1 reproduces the colocated tokens.
    params = SamplingParams(seed=7)
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0))
    first = Sampler()(logits, metadata([params], [[11]], vocab_size=500)).sampled_token_ids
    generator = make_generator(7)
    for _ in range(3):  # draws at other positions do not disturb position 1
        Sampler()(logits, metadata([params], [[]], generators=[generator], vocab_size=500))
    again = Sampler()(logits, metadata([params], [[11]], generators=[generator], vocab_size=500))
    assert again.sampled_token_ids.tolist() == first.tolist()


def test_unseeded_rows_use_the_shared_generator():
    logits = torch.zeros(64, 100)
    meta = metadata([SamplingParams()] * 64, vocab_size=100)
    a = Sampler(torch.Generator().manual_seed(5))(logits, meta).sampled_token_ids
    b = Sampler(torch.Generator().manual_seed(5))(logits, meta).sampled_token_ids
    c = Sampler(torch.Generator().manual_seed(6))(logits, meta).sampled_token_ids
    assert a.tolist() == b.tolist() != c.tolist()


# ---- processors: exact values ------------------------------------------------------------


def test_penalties_change_logits_exactly():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]] * 2)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    meta = metadata([params, SamplingParams(temperature=0.0)], outputs=[[2, 2, 3], [2, 2, 3]],
                    prompts=[[0, 1], [0, 1]], vocab_size=6)
    process_logits(logits, meta)
    # repetition over prompt+output {0,1,2,3}: 2/2, -1*2, .5/2, -.5*2; then frequency
    # (0.5 x count) and presence (0.25) over output {2: 2, 3: 1}.
    assert logits[0].tolist() == [1.0, -2.0, 0.25 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 3.0, 1.0]
    assert logits[1].tolist() == [2.0, -1.0, 0.5, -0.5, 3.0, 1.0]  # no penalties: untouched


def test_apply_penalties_repetition_only_spares_unseen_tokens():
    logits = torch.tensor([[4.0, -4.0, 4.0, -4.0]])
    counts = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    prompt = torch.tensor([[True, False, False, False]])
    one = torch.tensor([1.0])
    apply_penalties(logits, prompt, counts, torch.tensor([1.6]), 0 * one, 0 * one)
    assert logits.tolist() == [[2.5, -4.0, 2.5, -4.0]]


def test_masks_bias_allowed_bad_words_and_min_tokens():
    base = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    neg = -math.inf
    cases = [
        (SamplingParams(logit_bias={0: 10.0, 5: -1.5}), [], [11.0, 2.0, 3.0, 4.0, 5.0, 4.5]),
        (SamplingParams(allowed_token_ids=[1, 3]), [], [neg, 2.0, neg, 4.0, neg, neg]),
        (SamplingParams(bad_words_token_ids=[[4], [2, 5]]), [0, 2], [1, 2, 3, 4, neg, neg]),
        (SamplingParams(bad_words_token_ids=[[4], [2, 5]]), [2, 0], [1, 2, 3, 4, neg, 6]),
        (SamplingParams(bad_words_token_ids=[[1, 2, 3]]), [1, 2], [1, 2, 3, neg, 5, 6]),
        # min_tokens: EOS (0) and stop_token_ids (5) banned while output is shorter.
        (SamplingParams(min_tokens=3, stop_token_ids=[5]), [1, 1], [neg, 2, 3, 4, 5, neg]),
        (SamplingParams(min_tokens=3, stop_token_ids=[5]), [1, 1, 1], [1, 2, 3, 4, 5, 6]),
        (SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True), [1],
         [1, 2, 3, 4, 5, neg]),
    ]
    params = [SamplingParams(temperature=0.0).replace(**{
        k: getattr(p, k) for k in ("logit_bias", "allowed_token_ids", "bad_words_token_ids",
                                   "min_tokens", "stop_token_ids", "ignore_eos")})
        for p, _, _ in cases]
    logits = base.expand(len(cases), -1).clone()
    process_logits(logits, metadata(params, [o for _, o, _ in cases], vocab_size=6,
                                    eos_token_ids=[0]))
    for row, (_, _, want) in enumerate(cases):
        assert logits[row].tolist() == [float(x) for x in want], f"case {row}"


def test_empty_support_raises_naming_request_and_parameters():
    params = SamplingParams(allowed_token_ids=[0], min_tokens=2)
    meta = metadata([SamplingParams(), params], vocab_size=6, eos_token_ids=[0],
                    request_ids=["a", "b"])
    with pytest.raises(ValueError, match=r"^request b: no token can be sampled; every token is "
                                         r"masked by allowed_token_ids=\[0\], min_tokens=2"):
        Sampler()(torch.zeros(2, 6), meta)


def test_non_finite_logits_raise_instead_of_sampling_nan():
    logits = torch.zeros(2, 6)
    logits[1, 3] = math.nan
    meta = metadata([SamplingParams(), SamplingParams()], vocab_size=6, request_ids=["a", "b"])
    with pytest.raises(ValueError, match=r"^request b: the model's logits are not finite"):
        Sampler()(logits, meta)


def test_common_path_carries_no_optional_tensors():
    meta = metadata([SamplingParams(), SamplingParams(temperature=0.0)])
    assert meta.no_penalties and meta.top_k is None and meta.top_p is None
    assert meta.min_p is None and meta.bias_index is None and meta.ban_index is None
    assert meta.allowed_rows is None and meta.max_num_logprobs is None
    # greedy rows never truncate, so their processed logprobs do not depend on the batch
    assert metadata([SamplingParams(temperature=0.0, top_k=2)]).top_k is None


def test_sampler_does_not_modify_its_input():
    logits = LOGITS.expand(2, -1).clone()
    before = logits.clone()
    Sampler()(logits, metadata([SamplingParams(temperature=0.5, top_k=2,
                                               repetition_penalty=1.5)] * 2, [[1], [3]]))
    assert torch.equal(logits, before)


# ---- logprobs and probs ------------------------------------------------------------------


def test_processed_logprobs_are_log_softmax_after_processors():
    params = SamplingParams(temperature=0.7, top_k=3, logprobs=4, seed=0)
    out = Sampler()(LOGITS.unsqueeze(0), metadata([params]))
    masked = LOGITS / 0.7
    masked[[2, 4, 5, 6, 7]] = -math.inf  # outside the top 3 (tokens 1, 3, 0)
    want = masked.log_softmax(-1)
    [pos] = out.logprobs.tolists([4])
    token = out.sampled_token_ids.item()
    assert pos.token_id == token and pos.logprob == pytest.approx(want[token].item(), abs=1e-6)
    assert [t for t, _ in pos.top[:3]] == [1, 3, 0]
    for (_, lp), w in zip(pos.top[:3], want[[1, 3, 0]].tolist()):
        assert lp == pytest.approx(w, abs=1e-6)
    assert pos.top[3][1] == -math.inf  # only three tokens are possible
    assert pos.rank == [1, 3, 0].index(token) + 1


def test_raw_logprobs_ignore_processors_and_modes_mix_per_row():
    raw = SamplingParams(temperature=0.0, logprobs=2, logprobs_mode="raw", logit_bias={7: 100})
    processed = SamplingParams(temperature=0.0, logprobs=2, logit_bias={7: 100})
    none = SamplingParams(temperature=0.0)
    out = Sampler()(LOGITS.expand(3, -1), metadata([raw, processed, none]))
    assert out.sampled_token_ids.tolist() == [7, 7, 1]
    p_raw, p_processed, p_none = out.logprobs.tolists([2, 2, None])
    want = LOGITS.log_softmax(-1)
    assert p_raw.logprob == pytest.approx(math.log(0.05), abs=1e-6) and p_raw.rank == 5
    assert [t for t, _ in p_raw.top] == [1, 3]
    assert [lp for _, lp in p_raw.top] == pytest.approx(want[[1, 3]].tolist(), abs=1e-6)
    assert p_processed.rank == 1 and p_processed.top[0][0] == 7 and p_none is None


def test_logprobs_zero_returns_only_the_sampled_token():
    out = Sampler()(LOGITS.unsqueeze(0), metadata([SamplingParams(temperature=0, logprobs=0)]))
    [pos] = out.logprobs.tolists([0])
    assert pos.token_id == 1 and pos.rank == 1 and pos.top == []
    assert pos.logprob == pytest.approx(math.log(0.4), abs=1e-6)


def test_compute_probs_is_the_sampled_distribution():
    params = [SamplingParams(top_p=0.6), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5)]
    probs = compute_probs(LOGITS.expand(3, -1), metadata(params))
    assert probs.dtype == torch.float32
    assert probs[0].tolist() == pytest.approx(expected({1: 0.4, 3: 0.25}).tolist(), abs=1e-6)
    assert probs[1].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]  # greedy: one-hot at argmax
    assert probs[2].tolist() == pytest.approx((PROBS**2 / (PROBS**2).sum()).tolist(), abs=1e-6)
    # 1 - 1e-9 rounds to 1 in fp32: the most likely token must survive anyway.
    tiny_p = compute_probs(LOGITS.unsqueeze(0), metadata([SamplingParams(top_p=1e-9)]))
    assert tiny_p[0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]


def test_prompt_logprobs():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(9))
    next_ids = torch.tensor([3, 0, 9, 3])
    result = compute_prompt_logprobs(logits, next_ids, 2)
    assert len(result) == 5 and result[0] is None
    want = logits.log_softmax(-1)
    for t, pos in enumerate(result[1:]):
        token = next_ids[t].item()
        assert pos.token_id == token
        assert pos.logprob == pytest.approx(want[t, token].item(), abs=1e-6)
        assert pos.rank == int((want[t] > want[t, token]).sum()) + 1
        assert [i for i, _ in pos.top] == want[t].topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits, next_ids, 0, include_first=False)[0].top == []


def test_row_argmax_is_argmax_including_ties():
    from engine.sampling.sampler import row_argmax

    logits = torch.randn(6, 49152)
    logits[1, [7, 300, 49151]] = 1e4  # ties: the first wins
    logits[2] = 0.0
    logits[3, -1] = 1e4
    logits[4, :5] = float("-inf")
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
    assert row_argmax(logits)[1] == 7 and row_argmax(logits)[2] == 0


def test_argmax_rows_is_the_samplers_greedy_result_and_defers_non_finite_rows():
    from engine.sampling.metadata import takes_argmax
    from engine.sampling.sampler import argmax_rows

    logits = torch.randn(3, 100)
    logits[1, [4, 9]] = 50.0  # a tie: the first
    greedy = SamplingParams(temperature=0.0)
    metadata = SamplingMetadata.from_requests([greedy] * 3, [[1]] * 3, [[2]] * 3, None, 100)
    assert argmax_rows(logits) == Sampler()(logits, metadata).sampled_token_ids.tolist()
    logits[2, 0] = float("nan")
    assert argmax_rows(logits) is None
    logits[2] = float("-inf")
    assert argmax_rows(logits) is None
    # which rows qualify: greedy and nothing that touches the logits or asks for logprobs
    assert takes_argmax(greedy, [1], eos_token_ids=[0])
    for params, output in ((SamplingParams(temperature=0.5), [1]), (SamplingParams(temperature=0.0, logprobs=2), [1]),
                           (SamplingParams(temperature=0.0, repetition_penalty=1.2), [1]),
                           (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), [1]),
                           (SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]), [1]),
                           (SamplingParams(temperature=0.0, min_tokens=4), [1])):
        assert not takes_argmax(params, output, eos_token_ids=[0]), params
    assert takes_argmax(SamplingParams(temperature=0.0, min_tokens=1), [1], eos_token_ids=[0])


def test_argmax_rows_one_copy_and_none_for_a_row_without_a_finite_maximum():
    from engine.sampling.sampler import argmax_rows

    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, -1.0, float("-inf")]])
    assert argmax_rows(logits) == [1, 0]
    assert argmax_rows(torch.tensor([[0.0, 1.0], [float("nan"), float("nan")]])) is None
    assert argmax_rows(torch.full((2, 3), float("-inf"))) is None
