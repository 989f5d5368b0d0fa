"""What one step of the runner gives back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling.logprobs import PositionLogprobs


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # per request id
    # this step's chunk only; None at prompt position 0
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
