"""Parallel samples (n > 1) waiting to fork from their first sample, and the forks' planning.

Samples 1..n-1 of a request wait here, keyed by sample 0's id, until sample 0's prompt is
computed; then as many as there are seats fork from it (share its prompt blocks, copy-on-write)
and the rest go to the front of the queue to compute the prompt themselves::

    forks.add("r/0", r1); forks.add("r/0", r2)    # r1, r2 wait on r/0
    rest = forks.keep_first("r/0", num_seats)     # the step that completes r/0's prompt
    children = forks.take("r/0")                  # forked: they run from now on

The scheduler does the last two through ``plan`` (after a schedule: who forks this step) and
``with_forks`` (at the update: the forked join the running requests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler.output import SchedulerOutput


class PendingForks:
    def __init__(self) -> None:
        self._children: dict[str, list[Request]] = {}

    def add(self, parent_id: str, child: Request) -> None:
        self._children.setdefault(parent_id, []).append(child)

    def of(self, parent_id: str) -> list[Request]:
        """The samples waiting on ``parent_id`` (empty if none)."""
        return self._children.get(parent_id, [])

    def keep_first(self, parent_id: str, count: int) -> list[Request]:
        """Keep the first ``count`` samples waiting on ``parent_id``; return the others."""
        children = self._children.get(parent_id, [])
        rest = children[count:]
        del children[count:]
        if not children:
            self._children.pop(parent_id, None)
        return rest

    def take(self, parent_id: str) -> list[Request]:
        """Remove and return every sample waiting on ``parent_id``."""
        return self._children.pop(parent_id, [])

    def drop(self, child: Request) -> None:
        """``child`` no longer waits (it finished or was aborted)."""
        for parent_id, children in self._children.items():
            if child in children:
                children.remove(child)
                if not children:
                    del self._children[parent_id]
                return

    def num_waiting_on(self, is_counted: Callable[[str], bool]) -> int:
        """Samples waiting on the parents for which ``is_counted(parent_id)``."""
        return sum(len(c) for parent_id, c in self._children.items() if is_counted(parent_id))

    def plan(self, out: SchedulerOutput, num_free_seats: Callable[[], int]) -> list[Request]:
        """The samples of a request whose prompt completes in ``out`` fork from it (the runner
        samples their first tokens from its last logits row: ``out.fork_children``), as many as
        there are seats (``num_free_seats()`` counts the waiting samples as seated). Returns the
        others, for the front of the queue: they compute the prompt themselves (a prefix hit on
        its blocks once they are cached)."""
        front: list[Request] = []
        for request in out.scheduled:
            children = self.of(request.request_id)
            num_scheduled = out.num_scheduled_tokens[request.request_id]
            if not children or request.num_computed_tokens + num_scheduled < request.num_tokens:
                continue
            num_seats = num_free_seats() + len(children)
            front[:0] = self.keep_first(request.request_id, max(num_seats, 0))
            if children:
                out.fork_children[request.request_id] = list(children)
        return front

    def with_forks(self, out: SchedulerOutput, kv_manager: KVCacheManager,
                   running: list[Request]) -> Iterator[Request]:
        """The step's requests, each followed by the samples forked from it this step, which
        share its blocks and join ``running``. They fork before the parent's own update, which
        may finish it and free its blocks."""
        if not out.fork_children:
            yield from out.scheduled
            return
        for request in out.scheduled:
            children = [] if request.is_finished else [  # aborted while the step ran
                c for c in out.fork_children.get(request.request_id, ()) if not c.is_finished]
            if children:
                self.take(request.request_id)
                for child in children:
                    kv_manager.fork(request.request_id, child.request_id)
            yield request
            for child in children:
                child.status = RequestStatus.RUNNING
                child.num_computed_tokens = request.num_prompt_tokens
                child.num_cached_tokens = request.num_cached_tokens
                child.prompt_logprobs = request.prompt_logprobs
                out.num_scheduled_tokens[child.request_id] = 0
                running.append(child)
                yield child

    def __iter__(self) -> Iterator[Request]:
        for children in self._children.values():
            yield from children

    def __repr__(self) -> str:
        return f"PendingForks({ {p: [c.request_id for c in cs] for p, cs in self._children.items()} })"
