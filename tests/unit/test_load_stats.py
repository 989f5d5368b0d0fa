"""The load suite's statistics on fixed inputs: percentiles, ITL/TPOT from chunk stamps, goodput."""

from __future__ import annotations

import math

import pytest

from loadtests.load.record import HTTP_5XX, TIMEOUT, RequestRecord
from loadtests.load.stats import SLO, distribution, meets_slo, percentile, summarize


def record(index: int, sent: float, stamps: list[float], tokens: int, error_kind: str = "") -> RequestRecord:
    finished = stamps[-1] if stamps else sent + 1.0
    return RequestRecord(index, "c", sent=sent, stamps=stamps, finished=finished, status=200,
                         completion_tokens=tokens, prompt_tokens=10, error_kind=error_kind, tokens_from="usage")


def test_percentile_interpolates_linearly() -> None:
    assert percentile([1, 2, 3, 4], 0.5) == 2.5
    assert percentile([4, 1, 3, 2], 0.0) == 1
    assert percentile([4, 1, 3, 2], 1.0) == 4
    assert percentile(list(range(101)), 0.99) == 99
    assert percentile([10, 20], 0.9) == pytest.approx(19.0)
    assert percentile([7], 0.99) == 7
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError, match="quantile"):
        percentile([1], 1.5)


def test_distribution_keys() -> None:
    d = distribution([1.0, 2.0, 3.0])
    assert d == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}


def test_itl_ttft_tpot_from_chunk_stamps() -> None:
    r = record(0, sent=10.0, stamps=[10.5, 10.6, 10.8, 11.1], tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.6 / 3)
    # a chunk may carry several tokens: TPOT divides by tokens, ITL stays per chunk
    r = record(1, sent=0.0, stamps=[1.0, 2.0], tokens=11)
    assert r.itl == [1.0] and r.tpot == pytest.approx(0.1)
    assert record(2, sent=0.0, stamps=[0.3], tokens=1).tpot is None


def test_goodput_counts_both_slos_and_failures() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    good = record(0, 0.0, [0.5, 0.6, 0.7], tokens=3)              # TTFT 0.5, TPOT 0.1
    slow_first = record(1, 0.0, [1.5, 1.55, 1.6], tokens=3)       # TTFT over
    slow_decode = record(2, 1.0, [1.2, 1.5, 1.9], tokens=3)       # TPOT 0.35
    one_token = record(3, 2.0, [2.9], tokens=1)                   # no TPOT: meets it
    failed = record(4, 3.0, [], tokens=0, error_kind=HTTP_5XX)
    timed_out = record(5, 3.0, [], tokens=0, error_kind=TIMEOUT)
    records = [good, slow_first, slow_decode, one_token, failed, timed_out]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False, False]
    s = summarize(records, slo, num_not_sent=2)
    assert s["num_requests"] == 6 and s["num_ok"] == 4 and s["num_not_sent"] == 2
    assert s["failures"] == {"http_5xx": 1, "timeout": 1}
    assert s["duration_s"] == pytest.approx(4.0)                   # sent 0.0 .. failed finished 4.0
    assert s["num_good"] == 2
    assert s["goodput_per_s"] == pytest.approx(0.5)
    assert s["goodput_fraction"] == pytest.approx(2 / 6)
    assert s["output_tokens"] == 10 and s["output_tok_per_s"] == pytest.approx(2.5)
    assert s["request_per_s"] == pytest.approx(1.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.7)                # of 0.2, 0.5, 0.9, 1.5
    assert s["itl_s"]["p50"] == pytest.approx(0.1)                 # of .05 .05 .1 .1 .3 .4 (per chunk)
    assert s["tokens_from"] == {"usage": 4}


def test_record_json_round_trip() -> None:
    r = record(7, 100.0, [100.5, 100.75], tokens=2)
    back = RequestRecord.from_json(r.to_json(origin=100.0))
    assert back.stamps == [0.5, 0.75] and back.sent == 0.0 and back.tpot == pytest.approx(0.25)
