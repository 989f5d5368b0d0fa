"""The benchmarks' timer: the best of several timed calls (the least disturbed one on a shared
machine), after untimed warm-up calls. ``kernels/`` and ``loadtests/`` both use it."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` (seconds), after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best
