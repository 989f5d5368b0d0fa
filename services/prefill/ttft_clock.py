"""A prefill worker's share of one request's time to first token, by stage.

    decode_admit     ReserveBlocks on the decode worker (absent when max_tokens == 1)
    prefill_queue    waiting for the engine to take the request
    prefill_compute  computing the prompt, less the chunk pushes in between
    kv_transfer      pushing finished chunks before the first token (with a transfer only)

Seconds; sent with the first token (``FirstToken.stages``) so the router can break a slow
TTFT down (services/router/pipeline/debug_route.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TtftClock:
    """Call ``on_*`` as the request reaches each point; ``on_first_token`` gives the stages."""

    started_at: float = field(default_factory=time.monotonic)  # time.monotonic()
    queued_at: float = 0.0
    taken_at: float = 0.0
    push_s: float = 0.0
    first_token_at: float | None = None
    stages: dict[str, float] = field(default_factory=dict)

    def on_reserved(self) -> None:
        self.stages["decode_admit"] = time.monotonic() - self.started_at

    def on_queued(self) -> None:
        self.queued_at = time.monotonic()

    def on_taken(self) -> None:
        self.taken_at = time.monotonic()

    def on_pushed(self, push_s: float) -> None:
        """A chunk push took ``push_s``: TTFT's transfer stage while no first token yet."""
        if self.first_token_at is None:
            self.push_s += push_s

    def on_first_token(self, has_transfer: bool) -> dict[str, float]:
        self.first_token_at = time.monotonic()
        self.stages["prefill_queue"] = self.taken_at - self.queued_at
        self.stages["prefill_compute"] = self.first_token_at - self.taken_at - self.push_s
        if has_transfer:
            self.stages["kv_transfer"] = self.push_s
        return self.stages
