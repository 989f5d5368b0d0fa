"""What a serving engine did over the last interval, one log line while it works.

    engine: 2,345 steps in 10.0 s (234.5/s, 4.26 ms apart), 57.3 rows per step, 13,120 tokens
    out (1,312/s), 98% of steps chained; running 60, waiting 0, KV 35% used; device 3.91 ms
    per step, busy 92%

The line says whether a worker is slow (steps far apart) or starved (few rows per step) under
load, the first question about a served path that falls behind the offline engine, as vLLM's
periodic stats line does; on CUDA, whether its steps are slow on the device (busy near 100%:
the work, or another process's kernels time-sliced in) or the device waits for the host
between them (``engine/step_timer.py``). The engine thread observes after each loop iteration
(a clock read and a comparison); at rest nothing steps and nothing is logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.stats import EngineStats

LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class Tally:
    """Cumulative counts at one moment."""

    at: float  # time.monotonic()
    num_steps: int
    num_step_rows: int
    num_chained_steps: int
    num_tokens_out: int
    device_s: float = 0.0  # StepTimer: device time of the steps booked so far, and how many
    num_device_timed: int = 0


def describe(before: Tally, now: Tally, stats: EngineStats) -> str | None:
    """The line for the interval ``before`` -> ``now``; None when no step ran in it."""
    steps = now.num_steps - before.num_steps
    seconds = now.at - before.at
    if steps <= 0 or seconds <= 0:
        return None
    rows = now.num_step_rows - before.num_step_rows
    tokens = now.num_tokens_out - before.num_tokens_out
    chained = now.num_chained_steps - before.num_chained_steps
    used = 1 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
    return (f"engine: {steps:,} steps in {seconds:.1f} s ({steps / seconds:.1f}/s, "
            f"{seconds / steps * 1000:.2f} ms apart), {rows / steps:.1f} rows per step, "
            f"{tokens:,} tokens out ({tokens / seconds:,.0f}/s), {chained / steps:.0%} of steps "
            f"chained; running {stats.num_running_requests}, waiting {stats.num_waiting_requests}, "
            f"KV {used:.0%} used{_device(before, now)}")


def _device(before: Tally, now: Tally) -> str:
    timed = now.num_device_timed - before.num_device_timed
    if timed <= 0:
        return ""
    device_s = now.device_s - before.device_s
    return (f"; device {device_s / timed * 1000:.2f} ms per step, busy "
            f"{min(device_s / (now.at - before.at), 1.0):.0%}")


class Timed(Protocol):
    """What ``StepLog`` reads of an engine's ``StepTimer`` (engine/step_timer.py)."""

    seconds: float
    num_timed: int


class Counted(Protocol):
    """What ``StepLog`` reads of an engine (``EngineCore``)."""

    num_steps: int
    num_step_rows: int
    num_chained_steps: int

    @property
    def step_timer(self) -> Timed: ...

    def stats(self) -> EngineStats: ...


class StepLog:
    """``describe`` fed from the engine thread: ``num_tokens_out`` grows with each dispatch;
    ``observe`` after each loop iteration returns the line once an interval has passed since
    the last line, or since the engine last stood still (so an interval does not average in
    the rest before a load); None otherwise. The engine's stats are only read for a line."""

    def __init__(self, now: float, interval_s: float = LOG_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.num_tokens_out = 0
        self._last = Tally(now, 0, 0, 0, 0)

    def observe(self, now: float, core: Counted) -> str | None:
        timer = core.step_timer
        if core.num_steps == self._last.num_steps:  # at rest: the next interval starts with a step
            self._last = Tally(now, self._last.num_steps, self._last.num_step_rows,
                               self._last.num_chained_steps, self.num_tokens_out, timer.seconds,
                               timer.num_timed)
            return None
        if now - self._last.at < self.interval_s:
            return None
        tally = Tally(now, core.num_steps, core.num_step_rows, core.num_chained_steps,
                      self.num_tokens_out, timer.seconds, timer.num_timed)
        before, self._last = self._last, tally
        return describe(before, tally, core.stats())
