"""What the engine asks of speculative decoding each step, and speculation turned off.

``SpecDecoder`` (``decoder.py``) proposes drafts; ``NoSpecDecoder`` proposes none, so the engine
step is the same code with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine.request import Request
    from engine.scheduler.output import SchedulerOutput


class SpecDecoderProtocol(Protocol):
    """Per step: ``plan`` before the schedule, ``fill`` after it, ``record`` after the forward."""

    def plan(self, running: list[Request], max_model_len: int) -> None:
        """Give each decoding request its draft slots (``request.spec_token_ids``)."""

    def fill(self, sched: SchedulerOutput, block_ids: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor | None]:
        """Trim drafts to what the schedule allowed and write them; returns each drafted
        request's draft probabilities q (None: a point mass) for the rejection sampler."""
        ...

    def record(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Acceptance statistics of the step that ran ``sched``."""

    def remove(self, request_id: str) -> None:
        """``request_id`` finished or was aborted: forget its state."""

    def stats(self) -> dict[str, object] | None:
        """Proposed / accepted drafts per position; None when speculation is off."""
        ...


class NoSpecDecoder:
    """Speculative decoding turned off (no ``spec.method``): no drafts, no statistics."""

    def plan(self, running: list[Request], max_model_len: int) -> None:
        pass

    def fill(self, sched: SchedulerOutput, block_ids: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor | None]:
        return {}

    def record(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass

    def stats(self) -> dict[str, object] | None:
        return None
