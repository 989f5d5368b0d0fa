"""AdaptiveK: exact k sequences under a given acceptance history, threshold, probing, statistics."""

from __future__ import annotations

import pytest

from engine.spec_decode.adaptive import AdaptiveK, AdaptiveKConfig

# max_k 4, ema_weight 0.3, initial rate 0.7, min_draft_accept_prob 0.3:
# k = floor(log 0.3 / log rate) -> rate 0.7: 3, 0.49: 1, 0.343: 1, 0.2401: 0.
CONFIG = AdaptiveKConfig(max_k=4, batch_size_threshold=16, ema_weight=0.3,
                         initial_acceptance_rate=0.7, min_draft_accept_prob=0.3,
                         probe_interval=3, probe_k=1)


def test_k_shrinks_to_zero_under_low_acceptance():
    policy = AdaptiveK(CONFIG)
    ks = []
    for _ in range(4):
        k = policy.next_k("r", batch_size=1)
        ks.append(k)
        policy.record("r", num_proposed=k, num_accepted=0)
    assert ks == [3, 1, 1, 0]
    assert policy.acceptance_rate("r") == pytest.approx(0.7 * 0.7 ** 3)


def test_high_acceptance_reaches_max_k():
    policy = AdaptiveK(CONFIG)
    for _ in range(5):
        k = policy.next_k("r", batch_size=1)
        policy.record("r", num_proposed=k, num_accepted=k)
    assert policy.next_k("r", batch_size=1) == 4


def test_zero_at_or_above_batch_threshold():
    policy = AdaptiveK(CONFIG)
    assert policy.next_k("r", batch_size=15) == 3
    assert policy.next_k("r", batch_size=16) == 0
    assert policy.next_k("r", batch_size=200) == 0
    assert policy.next_k("r", batch_size=15) == 3


def test_probe_lets_a_request_recover():
    policy = AdaptiveK(CONFIG)
    for k in (3, 1, 1):
        policy.record("r", num_proposed=k, num_accepted=0)
    # rate 0.2401 -> k 0; every probe_interval-th call probes with probe_k drafts.
    assert [policy.next_k("r", batch_size=1) for _ in range(6)] == [0, 0, 1, 0, 0, 1]
    # Above the threshold nothing is learned, so those calls do not count towards a probe.
    assert [policy.next_k("r", batch_size=99) for _ in range(5)] == [0] * 5
    assert [policy.next_k("r", batch_size=1) for _ in range(2)] == [0, 0]
    # The probe's draft is accepted, and so are the next ones: k climbs back.
    ks = [policy.next_k("r", batch_size=1)]
    for _ in range(4):
        policy.record("r", num_proposed=ks[-1], num_accepted=ks[-1])
        ks.append(policy.next_k("r", batch_size=1))
    assert ks == [1, 1, 2, 3, 4]  # rates 0.468, 0.628, 0.739, 0.818


def test_costly_drafts_cap_k_at_the_best_tokens_per_cost():
    def k_at(rate, draft_cost, verify_cost=0.0, max_k=4):
        policy = AdaptiveK(AdaptiveKConfig(max_k=max_k, initial_acceptance_rate=rate,
                                           draft_cost=draft_cost, verify_cost=verify_cost))
        return policy.next_k("r", batch_size=1)

    assert k_at(0.9, 0.0) == 4  # free drafts: the rate rule alone
    # E(k) / (1 + k c) at rate 0.9, c = 0.3: 1.46, 1.59, 1.66, 1.70 -> every draft still pays
    assert k_at(0.9, 0.25, 0.05) == 4
    # rate 0.6, c = 0.3: E = 1.6, 1.96, 2.18 over 1.3, 1.6, 1.9 -> 1.23, 1.225, 1.15: k = 1
    assert k_at(0.6, 0.3) == 1
    # a drafter as costly as the target never pays: (1 + a) / 2 < 1 for every a < 1
    assert k_at(0.95, 1.0) == 0
    assert k_at(1.0, 1.0) == 0  # even a perfect drafter only breaks even: (1 + 1) / 2


def test_verification_costs_more_in_a_bigger_batch():
    policy = AdaptiveK(AdaptiveKConfig(max_k=4, batch_size_threshold=64, initial_acceptance_rate=0.8,
                                       verify_cost=0.1, verify_batch_knee=4.0))
    # rate 0.8: E(k) = 1.8, 2.44, 2.952, 3.3616. Batch 2: c = 0.1 -> 1.64, 2.03, 2.27, 2.40: k = 4.
    assert policy.next_k("r", batch_size=2) == 4
    # Batch 16: c = 0.4 -> 1.29, 1.36, 1.34, 1.29: k = 2. Batch 40: c = 1.0 -> 0.9, ...: none.
    assert policy.next_k("r", batch_size=16) == 2
    assert policy.next_k("r", batch_size=40) == 0


def test_costly_drafts_probe_less_often():
    cheap = AdaptiveK(AdaptiveKConfig(probe_interval=16, draft_cost=0.0, verify_cost=0.05))
    costly = AdaptiveK(AdaptiveKConfig(probe_interval=16, draft_cost=0.55, verify_cost=0.05,
                                       initial_acceptance_rate=0.1, max_probe_overhead=0.02))
    assert cheap.probe_interval(1) == 16
    assert costly.probe_interval(1) == 30  # one probe (0.6 steps of work) per 30 steps: <= 2%
    # batch 9 (verify_batch_knee 3): verification costs 0.15, a probe 0.7 steps -> every 35 steps
    assert costly.probe_interval(9) == 35 and cheap.probe_interval(9) == 16
    ks = [costly.next_k("r", batch_size=1) for _ in range(60)]
    assert ks.count(1) == 2 and ks[29] == 1 and ks[59] == 1


def test_a_drafter_as_costly_as_the_target_never_drafts():
    policy = AdaptiveK(AdaptiveKConfig(draft_cost=0.95, verify_cost=0.05, initial_acceptance_rate=1.0))
    assert not policy.can_pay
    assert [policy.next_k("r", batch_size=1) for _ in range(200)] == [0] * 200  # no probes either


def test_rate_counts_only_judged_drafts():
    # 2 of 4 accepted: drafts 0, 1 accepted, 2 rejected, 3 never judged -> 2/3, not 2/4.
    policy = AdaptiveK(AdaptiveKConfig(ema_weight=1.0))
    policy.record("r", num_proposed=4, num_accepted=2)
    assert policy.acceptance_rate("r") == pytest.approx(2 / 3)
    policy.record("r", num_proposed=4, num_accepted=4)
    assert policy.acceptance_rate("r") == 1.0


def test_statistics_per_position_and_mean_accepted_length():
    policy = AdaptiveK(CONFIG)
    assert policy.mean_accepted_length == 0.0
    policy.record("a", num_proposed=4, num_accepted=2)
    policy.record("b", num_proposed=2, num_accepted=2)
    policy.record("a", num_proposed=3, num_accepted=0)
    policy.record("c", num_proposed=0, num_accepted=0)  # no drafts: not a speculative step
    policy.record("b", num_proposed=6, num_accepted=5)  # longer than max_k: lists grow
    assert policy.num_proposed_per_position == [4, 4, 3, 2, 1, 1]
    assert policy.num_accepted_per_position == [3, 3, 1, 1, 1, 0]
    assert policy.num_spec_steps == 4
    assert policy.mean_accepted_length == pytest.approx(9 / 4)


def test_remove_forgets_the_request_but_keeps_statistics():
    policy = AdaptiveK(CONFIG)
    for k in (3, 1, 1):
        policy.record("r", num_proposed=k, num_accepted=0)
    assert policy.next_k("r", batch_size=1) == 0
    policy.remove("r")
    policy.remove("never-seen")
    assert policy.next_k("r", batch_size=1) == 3
    assert policy.num_proposed_per_position[0] == 3


def test_bad_input_raises():
    policy = AdaptiveK(CONFIG)
    with pytest.raises(ValueError, match="num_accepted"):
        policy.record("r", num_proposed=2, num_accepted=3)
    with pytest.raises(ValueError, match="batch_size_threshold"):
        AdaptiveKConfig(batch_size_threshold=0)
    with pytest.raises(ValueError, match="probe_k"):
        AdaptiveKConfig(max_k=2, probe_k=3)
    with pytest.raises(ValueError, match="draft_cost"):
        AdaptiveKConfig(draft_cost=float("nan"))
    with pytest.raises(ValueError, match="max_probe_overhead"):
        AdaptiveKConfig(max_probe_overhead=0.0)
