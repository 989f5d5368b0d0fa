"""The router's record of its routing decisions: counts per ``path/reason`` and the time each
decision took (the router's added latency), in one small object a metrics exporter can read.

Keys are ``RoutePlan.key`` values: ``local/short_uncached``, ``local/decode_holds_prefix``,
``remote/prefix``, ``remote/load``, ``remote/imbalance``, ``remote/index_unavailable``, and
``remote/retry`` (a worker failed before the first event and the load policy picked again),
``remote/plan_error`` (the plan raised: a bug, logged; the load policy picked).
Updated on the router's event loop only. ``listener(path, reason)``, when set, hears every
decision (the router's ``pdserve_route_decisions_total``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class RouteDecisions:
    """``counts``: decisions per key since start. ``latencies_s``: the last ``max_samples``
    decision times in seconds (hashing, the index lookup and scoring)."""

    def __init__(self, max_samples: int = 10_000) -> None:
        if max_samples <= 0:
            raise ValueError(f"max_samples must be positive, got {max_samples}")
        self.counts: dict[str, int] = {}
        self.latencies_s: deque[float] = deque(maxlen=max_samples)
        self.listener: Callable[[str, str], None] | None = None

    def record(self, key: str, latency_s: float | None = None) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.listener is not None:
            path, _, reason = key.partition("/")
            self.listener(path, reason)
        if latency_s is not None:
            self.latencies_s.append(latency_s)

    def latency_quantile_s(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the recorded decision times; 0.0 when none."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        samples = sorted(self.latencies_s)
        if not samples:
            return 0.0
        return samples[min(int(q * len(samples)), len(samples) - 1)]

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
