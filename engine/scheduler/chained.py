"""Chained decode steps: the next decode step scheduled before this one's tokens are booked.

A step's sampled tokens reach the host only when the device has finished it. With async
scheduling (``engine/core.py``) the engine schedules and launches the next decode step first,
its input tokens fed on the device from the step in flight, and books the step in flight while
the next one runs: the host's scheduling, booking and output work overlaps the device's::

    host    | sched n | launch n | sched n+1 | launch n+1 | book n | (caller) | sched n+2 | ...
    device             | step n ...........  | step n+1 ............ | step n+2 ...

Step n+1 computes, for each request of step n, the token step n samples for it: the position
after its known tokens, ``num_tokens`` (step n computed all of them: a decode token, or a
prompt's last chunk). It is chained only when no other work waits for a synchronous schedule and
every token it samples can be drawn without the host knowing step n's (``samples_blind``):

- every running request was in step n and sampled there (none left out of the batch, no prompt
  chunk short of its end); none is chained that step n surely ends (``max_tokens``, the context
  length); every queued request that could be admitted samples blind too (no prompt logprobs),
  no prefix load is in flight and no parallel sample waits to fork;
- there are blocks for every chained request (nothing is preempted; all or none allocate).

Queued requests join the chained step after its fed rows, admitted as a synchronous schedule
admits them (prefix hits, chunked prompts, the seats and the budget; never a preemption), so that
the chain does not break at every arrival: a prompt's chunk, or on a decode worker one known
token of a request whose KV landed from a prefill worker. Such a step is not decode-only and
runs eagerly; a prompt that does not end in it breaks the chain after it.

A request that step n ends anyway (EOS, a stop token or string, an abort) had one token computed
for nothing in step n+1, which its booking drops. Its blocks are still being written by that
step when it finishes, so ``UnbookedSteps`` holds them until the step is booked: only then may
another request (or a KV transfer into them) reuse them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.request import Request, RequestStatus
from engine.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.kv_cache.manager import KVCacheManager
    from engine.scheduler.prefix_loads import PrefixLoads


class SchedulerState(Protocol):
    """What a chained schedule reads of the Scheduler (and its KV manager it allocates from)."""

    config: SchedulerConfig
    max_model_len: int
    kv_manager: KVCacheManager
    prefix: PrefixLoads
    running: list[Request]

    @property
    def waiting(self) -> Sequence[Request]: ...
    @property
    def forks(self) -> Iterable[Request]: ...


def schedule_chained(scheduler: SchedulerState, prev: SchedulerOutput,
                     samples_blind: Callable[[Request, int], bool],
                     admit: Callable[[SchedulerOutput, int], None]) -> SchedulerOutput | None:
    """The decode step after ``prev`` (a step launched and not booked), or None, with nothing
    changed, when the next step must wait for ``prev``'s tokens (the module's rules).
    ``samples_blind(request, n)``: whether its next token can be sampled on the device with
    ``n`` of its output tokens unknown to the host. ``admit(out, budget)``: the scheduler's
    admission of queued requests into ``out``, called only when each of them samples blind."""
    if scheduler.prefix.has_loads_in_flight or any(True for _ in scheduler.forks):
        return None
    queued = [r for r in scheduler.waiting if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)]
    if queued and len(scheduler.running) < scheduler.config.max_num_seqs and not all(
            samples_blind(r, 0) and r.sampling_params.prompt_logprobs is None for r in queued):
        return None  # its first token needs the host: a synchronous schedule admits it
    live = [r for r in prev.scheduled if not r.is_finished]
    if len(live) != len(scheduler.running) or len(live) > scheduler.config.max_num_batched_tokens:
        return None
    if any(r.num_computed_tokens + prev.num_scheduled_tokens[r.request_id] != r.num_tokens for r in live):
        return None  # a prompt chunk that samples nothing
    requests = [r for r in live if not _ends_after_one(r, scheduler.max_model_len)]
    if not requests or not all(samples_blind(r, 1) for r in requests):
        return None
    kv = scheduler.kv_manager
    for i, request in enumerate(requests):  # the token in flight is at position num_tokens
        if kv.allocate_slots(request.request_id, request.num_tokens + 1,
                             num_computed_tokens=request.num_tokens) is None:
            for allocated in requests[:i]:
                kv.truncate(allocated.request_id, allocated.num_tokens)
            return None
    out = SchedulerOutput(scheduled=list(requests), num_scheduled_tokens=dict.fromkeys(
        (r.request_id for r in requests), 1), num_fed=len(requests))
    if queued:  # they join after the fed rows, as far as seats, budget and blocks go
        admit(out, scheduler.config.max_num_batched_tokens - len(requests))
    out.copy_ops = kv.take_copy_ops()
    return out


def _ends_after_one(request: Request, max_model_len: int) -> bool:
    """Whether the next token (the one in flight) surely ends ``request``: its last by
    max_tokens or by the context length."""
    max_tokens = request.sampling_params.max_tokens
    return ((max_tokens is not None and request.num_output_tokens + 1 >= max_tokens)
            or request.num_tokens + 1 >= max_model_len)


@dataclass(slots=True)
class _Unbooked:
    request_ids: set[str]
    held_block_ids: list[int] = field(default_factory=list)


class UnbookedSteps:
    """Steps launched on the device and not booked yet, oldest first (two at most: the one
    being booked and the chained one), with the blocks held for the requests that finished
    while a step of them still writes their KV."""

    def __init__(self, kv_manager: KVCacheManager) -> None:
        self.kv_manager = kv_manager
        self._steps: deque[_Unbooked] = deque()

    def launched(self, out: SchedulerOutput) -> None:
        self._steps.append(_Unbooked({r.request_id for r in out.scheduled}))

    def booking(self) -> None:
        """The oldest step has finished on the device: forget it and free what it held."""
        step = self._steps.popleft()
        if step.held_block_ids:
            self.kv_manager.release_blocks(step.held_block_ids)

    def hold_if_written(self, request_id: str) -> None:
        """Before a finishing request's blocks are freed: if an unbooked step writes them, hold
        them until that step (the newest one that does) is booked."""
        for step in reversed(self._steps):
            if request_id in step.request_ids:
                block_ids = self.kv_manager.get_block_ids(request_id)
                self.kv_manager.hold_blocks(block_ids)
                step.held_block_ids += block_ids
                return
