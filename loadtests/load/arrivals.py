"""When requests are sent: a closed loop at a concurrency, or an open loop at a request rate.

    Arrival.closed(4)                  # 4 requests in flight; the next one starts when one ends
    Arrival.poisson(2.0)               # open loop: exponential gaps, 2 requests/s on average
    Arrival.gamma(2.0, burstiness=0.5) # open loop: gamma gaps, same mean rate, burstier (< 1)

Open-loop send times come from a seeded generator, so two targets get the same schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MODES = ("closed", "poisson", "gamma")


@dataclass(frozen=True)
class Arrival:
    """``mode`` is one of MODES; ``concurrency`` applies to ``closed``; ``rate`` (requests/s)
    and ``burstiness`` (the gamma shape: 1 = Poisson, < 1 burstier) to the open loops."""

    mode: str
    concurrency: int = 1
    rate: float = 0.0
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"arrival mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "closed" and self.concurrency < 1:
            raise ValueError(f"closed-loop concurrency must be >= 1, got {self.concurrency}")
        if self.mode != "closed" and not self.rate > 0:
            raise ValueError(f"open-loop rate must be > 0 requests/s, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    @classmethod
    def closed(cls, concurrency: int) -> Arrival:
        return cls("closed", concurrency=concurrency)

    @classmethod
    def poisson(cls, rate: float) -> Arrival:
        return cls("poisson", rate=rate)

    @classmethod
    def gamma(cls, rate: float, burstiness: float) -> Arrival:
        return cls("gamma", rate=rate, burstiness=burstiness)

    @property
    def is_open(self) -> bool:
        return self.mode != "closed"

    @property
    def label(self) -> str:
        """Short text for tables: ``c=4``, ``2 req/s``, ``2 req/s (gamma 0.5)``."""
        if self.mode == "closed":
            return f"c={self.concurrency}"
        text = f"{self.rate:g} req/s"
        return text if self.mode == "poisson" else f"{text} (gamma {self.burstiness:g})"

    @property
    def x(self) -> float:
        """The sweep axis value: concurrency (closed) or rate (open)."""
        return float(self.concurrency) if self.mode == "closed" else self.rate

    def send_offsets(self, num_requests: int, seed: int) -> list[float]:
        """Seconds after the start at which each request is sent (open loop; first at 0)."""
        if not self.is_open:
            raise ValueError("a closed loop has no send schedule")
        rng = random.Random(seed)
        shape = 1.0 if self.mode == "poisson" else self.burstiness
        offsets, now = [], 0.0
        for _ in range(num_requests):
            offsets.append(now)
            # gamma(shape, scale) has mean shape * scale = 1 / rate
            now += rng.gammavariate(shape, 1.0 / (shape * self.rate))
        return offsets


def parse_arrivals(mode: str, values: str, burstiness: float = 1.0) -> list[Arrival]:
    """``--arrival closed --concurrency 1,4,16`` or ``--arrival poisson --rate 0.5,1,2`` as a sweep."""
    try:
        numbers = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {values!r}") from None
    if not numbers:
        raise ValueError(f"no sweep values in {values!r}")
    if mode == "closed":
        if any(n != int(n) for n in numbers):
            raise ValueError(f"concurrency must be whole numbers, got {values!r}")
        return [Arrival.closed(int(n)) for n in numbers]
    return [Arrival(mode, rate=n, burstiness=burstiness) for n in numbers]
