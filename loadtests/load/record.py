"""What the client saw of one request: chunk arrival times, token counts, and how it failed.

Times are ``time.perf_counter()`` seconds. ``stamps`` holds the arrival time of every streamed
chunk that carried text; the metrics (loadtests.load.stats) are derived from them:
TTFT = stamps[0] - sent; E2E = finished - sent; ITL = gaps between consecutive stamps;
TPOT = (E2E - TTFT) / (completion_tokens - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# failure kinds, for "failures by kind"
HTTP_4XX, HTTP_5XX, CONNECT, TIMEOUT, STREAM_ERROR, EMPTY = (
    "http_4xx", "http_5xx", "connect", "timeout", "stream_error", "empty")


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; ``error_kind`` is "" when it succeeded."""

    index: int
    class_name: str
    sent: float
    stamps: list[float] = field(default_factory=list)
    finished: float = 0.0
    status: int = 0
    error_kind: str = ""
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens_from: str = ""  # "usage" (the server's count) or "tokenizer" (counted here)
    text: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_kind

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.finished - self.sent

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None for a one-token answer."""
        if self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def to_json(self, origin: float) -> dict[str, Any]:
        """Compact JSON, times in seconds relative to ``origin`` (the run's start)."""
        return {"index": self.index, "class": self.class_name, "sent": round(self.sent - origin, 6),
                "finished": round(self.finished - origin, 6), "status": self.status,
                "error_kind": self.error_kind, "error": self.error,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "tokens_from": self.tokens_from,
                "stamps": [round(s - origin, 6) for s in self.stamps]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(index=data["index"], class_name=data["class"], sent=data["sent"], stamps=list(data["stamps"]),
                   finished=data["finished"], status=data["status"], error_kind=data["error_kind"],
                   error=data["error"], prompt_tokens=data["prompt_tokens"],
                   completion_tokens=data["completion_tokens"], tokens_from=data["tokens_from"])
