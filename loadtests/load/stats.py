"""Run metrics from request records: pure functions, no I/O.

Definitions (vLLM's ``bench serve``):
- TTFT, E2E, TPOT, ITL per request as in loadtests.load.record; percentiles interpolate linearly
  between order statistics (numpy's default), so p50 of [1, 2, 3, 4] is 2.5.
- duration: first send to last finish, seconds; request/s and output tok/s divide by it.
- goodput: successful requests with TTFT <= the TTFT SLO and TPOT <= the TPOT SLO (a one-token
  answer has no TPOT and meets that part), per second of duration; ``goodput_fraction`` divides
  them by all requests sent, failures included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtests.load.record import RequestRecord

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives, seconds."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation; NaN for no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (NaN when empty)."""
    mean = sum(values) / len(values) if values else float("nan")
    return {"mean": mean, **{f"p{round(q * 100)}": percentile(values, q) for q in QUANTILES}}


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    if not record.ok:
        return False
    tpot = record.tpot
    return record.ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


def run_duration(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first send to the last finish of one run's records (0 for none)."""
    finished = [r.finished for r in records if r.finished]
    return max(finished) - min(r.sent for r in records) if finished else 0.0


def summarize(records: Sequence[RequestRecord], slo: SLO, num_not_sent: int = 0,
              duration_s: float | None = None) -> dict[str, Any]:
    """The run's metrics. Latencies in seconds; ``failures`` maps failure kind to count;
    ``num_not_sent`` counts requests the time bound kept from being sent (not failures).
    ``duration_s`` (default: ``run_duration(records)``) must be the sum of the runs' own
    durations when ``records`` pools several runs (repeats), whose clocks differ."""
    ok = [r for r in records if r.ok]
    duration = run_duration(records) if duration_s is None else duration_s
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: float("nan"))
    num_good = sum(meets_slo(r, slo) for r in records)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    output_tokens = sum(r.completion_tokens for r in ok)
    return {
        "num_requests": len(records), "num_ok": len(ok), "num_not_sent": num_not_sent,
        "failures": dict(Counter(r.error_kind for r in records if not r.ok)),
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": output_tokens,
        "tokens_from": dict(Counter(r.tokens_from for r in ok)),
        "request_per_s": per_s(len(ok)), "output_tok_per_s": per_s(output_tokens),
        "ttft_s": distribution([r.ttft for r in ok]), "tpot_s": distribution(tpots),
        "itl_s": distribution([g for r in ok for g in r.itl]), "e2e_s": distribution([r.e2e for r in ok]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "num_good": num_good,
        "goodput_per_s": per_s(num_good), "goodput_fraction": num_good / len(records) if records else float("nan"),
    }
