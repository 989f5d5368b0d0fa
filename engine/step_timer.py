"""The device's time per engine step: two CUDA events around each step's launch.

A served engine that falls behind the offline one is either waiting for its device (a step takes
longer there: another process's kernels time-sliced in, a bigger batch) or its device waits for
it (the host between steps: scheduling, the GIL, the event loop). Steps per second alone cannot
tell the two apart; the device's time per step beside it can (the serving engine's log line,
``services/common/engine_log.py``).

Off until ``enabled`` (the serving engine thread turns it on; offline ``LLM.generate`` pays
nothing) and on a CPU, where a step is synchronous and its wall time is the device's. A pair of
events is recorded on the engine's stream before and after a step's launch, and read when the
step is booked: its tokens have reached the host by then, so both events have completed and
reading them never waits. Pairs are reused.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

EventPair = tuple[torch.cuda.Event, torch.cuda.Event]


class StepTimer:
    """``start`` before a step's launch, ``stop`` after it, ``book`` once its tokens are on the
    host; ``seconds`` sums the device time of the booked steps, ``num_timed`` counts them."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.enabled = False
        self.seconds = 0.0
        self.num_timed = 0
        self._free: list[EventPair] = []

    def start(self) -> EventPair | None:
        if not (self.enabled and self.is_cuda):
            return None
        pair = self._free.pop() if self._free else (
            torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
        pair[0].record()
        return pair

    @staticmethod
    def stop(pair: EventPair | None) -> None:
        if pair is not None:
            pair[1].record()

    def book(self, pair: EventPair | None) -> None:
        if pair is None:
            return
        try:
            # done: the step's tokens are on the host (so never false, and never a wait)
            if pair[1].query():  # type: ignore[no-untyped-call]
                self.seconds += pair[0].elapsed_time(pair[1]) / 1e3
                self.num_timed += 1
        except RuntimeError:  # a diagnostic: it must never fail a step
            log.exception("step timer off: its events could not be read")
            self.enabled = False
            return
        self._free.append(pair)
