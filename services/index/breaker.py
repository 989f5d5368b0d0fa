"""A circuit breaker for an advisory dependency: stop calling it while it fails, probe it back.

States: *closed* (calls go through), *open* (calls are refused at once until a backoff ends),
*half-open* (exactly one probe call goes through; success closes, failure reopens with the
backoff doubled, up to ``max_backoff_s``). ``failure_threshold`` consecutive failures open it.
Thread-safe; the clock is injectable so tests need not sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3
    base_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or not 0 < self.base_backoff_s <= self.max_backoff_s:
            raise ValueError(f"bad breaker config {self}: need failure_threshold >= 1 and "
                             "0 < base_backoff_s <= max_backoff_s")


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, config: BreakerConfig = BreakerConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._num_failures = 0
        self._backoff_s = config.base_backoff_s
        self._open_until = 0.0

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def backoff_s(self) -> float:
        """The backoff the next (or current) open period lasts, seconds."""
        return self._backoff_s

    def allow(self) -> bool:
        """May a call go through now? In the open state, the first call after the backoff
        becomes the half-open probe; others are refused until it reports."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._num_failures = 0
            self._backoff_s = self.config.base_backoff_s

    def record_failure(self) -> None:
        with self._lock:
            self._num_failures += 1
            if self._state is BreakerState.HALF_OPEN:
                self._backoff_s = min(2 * self._backoff_s, self.config.max_backoff_s)
                self._open(self._backoff_s)
            elif self._state is BreakerState.CLOSED and self._num_failures >= self.config.failure_threshold:
                self._open(self._backoff_s)

    def _open(self, backoff_s: float) -> None:
        self._state = BreakerState.OPEN
        self._open_until = self._clock() + backoff_s
