"""Running one request alone through an EngineCore, for the tier tests."""

from __future__ import annotations

from engine.core import EngineCore
from engine.sampling_params import SamplingParams

MAX_STEPS = 50


def run_alone(core: EngineCore, request_id: str, prompt: list[int],
              params: SamplingParams) -> tuple[list[int], int]:
    """(output tokens, prompt tokens served from cache) of ``prompt`` run with nothing else in
    ``core``, in at most MAX_STEPS steps; the core's integrity is checked after."""
    core.add_request(request_id, prompt, params)
    tokens, num_cached = [], -1
    for _ in range(MAX_STEPS):
        if not core.has_unfinished_requests():
            break
        for output in core.step():
            tokens += output.new_token_ids
            num_cached = output.num_cached_tokens
    assert not core.has_unfinished_requests()
    core.check_integrity()
    return tokens, num_cached
