"""The circuit breaker's states on an injected clock."""

from __future__ import annotations

import pytest

from services.index.breaker import BreakerConfig, BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_three_failures_and_probes_with_doubling_backoff():
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(3, 1.0, 30.0), clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now = 1.0
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # one probe at a time
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and breaker.backoff_s == 2.0
    clock.now = 2.9
    assert not breaker.allow()
    clock.now = 3.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.backoff_s == 1.0


def test_backoff_is_capped():
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(1, 1.0, 4.0), clock)
    breaker.record_failure()
    for expected in (2.0, 4.0, 4.0):
        clock.now += 100
        assert breaker.allow()
        breaker.record_failure()
        assert breaker.backoff_s == expected


def test_success_resets_the_failure_count():
    breaker = CircuitBreaker(BreakerConfig(3, 1.0, 30.0), Clock())
    for _ in range(5):
        breaker.record_failure()
        breaker.record_failure()
        breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerConfig(0, 1.0, 30.0)
