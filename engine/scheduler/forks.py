"""Parallel samples (n > 1) waiting to fork from their first sample.

Samples 1..n-1 of a request wait here, keyed by sample 0's id, until sample 0's prompt is
computed; then as many as there are seats fork from it (share its prompt blocks, copy-on-write)
and the rest go to the front of the queue to compute the prompt themselves::

    forks.add("r/0", r1); forks.add("r/0", r2)    # r1, r2 wait on r/0
    rest = forks.keep_first("r/0", num_seats)     # the step that completes r/0's prompt
    children = forks.take("r/0")                  # forked: they run from now on
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.request import Request


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

    def __iter__(self) -> Iterator[Request]:
        for children in self._children.values():
            yield from children

    def __repr__(self) -> str:
        return f"PendingForks({ {p: [c.request_id for c in cs] for p, cs in self._children.items()} })"
