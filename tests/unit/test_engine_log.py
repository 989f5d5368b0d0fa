"""services/common/engine_log.py: the engine's periodic line (pure: a clock and counters)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.stats import EngineStats
from services.common.engine_log import StepLog, Tally, describe

STATS = EngineStats(num_free_blocks=650, num_total_blocks=1000, block_size=16,
                    num_running_requests=60, num_waiting_requests=2,
                    num_outstanding_prefill_tokens=0)


@dataclass
class _Timer:  # what StepLog reads of a StepTimer
    seconds: float = 0.0
    num_timed: int = 0


@dataclass
class _Counts:  # what StepLog reads of an EngineCore, set by hand
    num_steps: int = 0
    num_step_rows: int = 0
    num_chained_steps: int = 0
    stats_reads: list[int] = field(default_factory=list)
    step_timer: _Timer = field(default_factory=_Timer)

    def stats(self) -> EngineStats:
        self.stats_reads.append(self.num_steps)
        return STATS


def test_describe_names_the_rate_the_rows_the_tokens_and_the_load():
    line = describe(Tally(100.0, 10, 100, 5, 50), Tally(110.0, 2355, 134_468, 2303, 13_170), STATS)
    assert line == ("engine: 2,345 steps in 10.0 s (234.5/s, 4.26 ms apart), 57.3 rows per step, "
                    "13,120 tokens out (1,312/s), 98% of steps chained; running 60, waiting 2, "
                    "KV 35% used")
    assert describe(Tally(100.0, 10, 100, 5, 50), Tally(110.0, 10, 100, 5, 50), STATS) is None


def test_a_line_per_interval_of_work_and_none_at_rest():
    counts = _Counts()
    step_log = StepLog(now=0.0, interval_s=10.0)
    assert step_log.observe(50.0, counts) is None  # at rest: silent, and the interval waits
    counts.num_steps, counts.num_step_rows = 100, 800  # the load starts after 50 s of rest
    step_log.num_tokens_out = 800
    assert step_log.observe(59.9, counts) is None  # not yet due
    line = step_log.observe(60.0, counts)
    assert line is not None and line.startswith("engine: 100 steps in 10.0 s (10.0/s, 100.00 ms apart), "
                                                 "8.0 rows per step, 800 tokens out (80/s), 0% of steps")
    assert counts.stats_reads == [100]  # read only for the line
    assert step_log.observe(75.0, counts) is None  # at rest again
    counts.num_steps += 1
    counts.num_chained_steps += 1
    assert step_log.observe(84.9, counts) is None
    line = step_log.observe(85.0, counts)
    assert line is not None and "1 steps in 10.0 s" in line and "100% of steps chained" in line
    with pytest.raises(ValueError, match="interval_s must be positive"):
        StepLog(now=0.0, interval_s=0)


def test_on_a_device_the_line_gives_its_time_per_step_and_how_busy_it_was():
    before, now = Tally(100.0, 10, 100, 5, 50, 1.0, 10), Tally(110.0, 2355, 134_468, 2303, 13_170, 10.17, 2355)
    line = describe(before, now, STATS)
    assert line is not None and line.endswith("KV 35% used; device 3.91 ms per step, busy 92%")
    counts = _Counts()
    step_log = StepLog(now=0.0, interval_s=10.0)
    step_log.observe(1.0, counts)
    counts.num_steps, counts.step_timer = 500, _Timer(4.0, 500)  # 8 ms per step, 10 s: 40% busy
    line = step_log.observe(11.0, counts)
    assert line is not None and line.endswith("device 8.00 ms per step, busy 40%")
    counts.num_steps += 100  # steps with no device time (a CPU engine): nothing about a device
    line = step_log.observe(21.0, counts)
    assert line is not None and "device" not in line
