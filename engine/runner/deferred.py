"""A step's sampled tokens while the device computes them (async scheduling).

``DeferredSteps.start`` queues the copy of a step's tokens to the host behind the step, with no
wait; ``DeferredTokens.output`` waits for that copy alone. Meanwhile ``chain_input`` hands the
tokens, still on the device, to the next step as its input ids. On CUDA the host copies land in
pinned buffers, two of them in turn: at most two steps are unbooked at once (``chained.py``), and
a third starts only after the older one was read.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.runner.output import RunnerOutput


class DeferredTokens:
    """One step's sampled tokens (greedy or drawn, ``ModelRunner._blind_tokens``): row i is
    ``requests[i]``'s, -1 where its logits had no finite maximum (``output`` then raises, as the
    synchronous sampler does)."""

    __slots__ = ("requests", "tokens", "_host", "_ready")

    def __init__(self, requests: list[Request], tokens: torch.Tensor, host: torch.Tensor,
                 ready: torch.cuda.Event | None) -> None:
        self.requests = requests
        self.tokens = tokens  # [rows] int64 on the device: read it before the next step's forward
        self._host, self._ready = host, ready

    def chain_input(self, requests: list[Request]) -> torch.Tensor:
        """The tokens this step samples for ``requests`` (some of its own, in its order), on the
        device, as the next step's input ids; -1 reads as 0 (booking this step raises first)."""
        tokens = self.tokens
        if len(requests) != len(self.requests):
            row = {r.request_id: i for i, r in enumerate(self.requests)}
            index = torch.tensor([row[r.request_id] for r in requests], device=tokens.device)
            tokens = tokens.index_select(0, index)
        return tokens.clamp(min=0)

    def output(self) -> RunnerOutput:
        """Wait for the tokens to reach the host; the step's output, as ``execute`` gives it."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens: list[int] = self._host.tolist()
        if min(tokens, default=0) < 0:
            request = self.requests[tokens.index(min(tokens))]
            raise ValueError(f"request {request.request_id}: the model's logits have no finite "
                             f"maximum (NaN, +inf, or all -inf)")
        return RunnerOutput(sampled={r.request_id: [t] for r, t in zip(self.requests, tokens)})


class DeferredSteps:
    """Starts ``DeferredTokens`` for up to ``max_rows`` rows on ``device``."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._buffers = [torch.empty(max_rows, dtype=torch.int64, pin_memory=self._cuda)
                         for _ in range(2 if self._cuda else 0)]
        self._events = [torch.cuda.Event() for _ in self._buffers]  # type: ignore[no-untyped-call]
        self._turn = 0

    def start(self, requests: list[Request], tokens: torch.Tensor) -> DeferredTokens:
        """Queue the copy of ``tokens`` ([rows] int64, one per request) to the host."""
        if not self._cuda:  # the tokens are already in host memory, and computed
            return DeferredTokens(requests, tokens, tokens, None)
        self._turn ^= 1
        host, ready = self._buffers[self._turn][:tokens.shape[0]], self._events[self._turn]
        host.copy_(tokens, non_blocking=True)
        ready.record()
        return DeferredTokens(requests, tokens, host, ready)
