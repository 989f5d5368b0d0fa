"""Keep CPython's cyclic garbage collector off the heap that outlives every request.

A full (generation 2) collection walks every tracked object: after imports, a model, a
tokenizer and (on CUDA) the graph runner, that is ~200,000-260,000 objects and ~100 ms on the
2-vCPU EPYC here, taken by whatever thread allocated last: an engine step, or the event loop that
serves every stream (measured there: under a c=64 load on ``pdserve up``, one 78-86 ms pause of
the router per 256 requests; offline, a 92-101 ms pause in every other 256 x 128-token
``generate`` of a 2-layer model; loadtests/bench_gc.py). Those objects are never garbage, so
the collector need not look at them:

* ``freeze_long_lived``: a service process, once started (model loaded, kernels compiled,
  graphs captured), collects once and moves everything alive to the permanent generation
  (``gc.freeze``); collections then walk only what was made since. ``thaw`` undoes it when
  the service stops. vLLM does the same after its warm-up; SGLang offers it (``freeze_gc``).
* ``frozen_during``: a bounded call in a library process (``LLM.generate``) freezes what
  exists when it starts and unfreezes it when it ends, so no object of the caller's is kept
  from the collector after the call: the frozen objects go back to the oldest generation.

Reference counting frees acyclic garbage as always; only cyclic garbage that existed before a
freeze waits for ``thaw`` (a service: its exit).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

_lock = threading.Lock()
_depth = 0  # frozen_during calls in progress
_owned = False  # the outermost frozen_during froze (nothing was frozen before): it unfreezes


def freeze_long_lived(context: str) -> int:
    """Collect, then freeze every object alive; returns how many are frozen (and logs it)."""
    with _lock:
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
    log.info("%s: %d objects frozen out of garbage collection (the heap made at start)",
             context, frozen)
    return frozen


def thaw() -> None:
    """Undo every freeze: the frozen objects go back to the oldest generation."""
    with _lock:
        gc.unfreeze()


@contextlib.contextmanager
def frozen_during() -> Iterator[None]:
    """Freeze what exists on entry; unfreeze on exit. Nested or concurrent calls: the last one
    out unfreezes. A heap frozen before the first one came in (``freeze_long_lived``, or the
    caller's own ``gc.freeze``) is left frozen."""
    global _depth, _owned
    with _lock:
        _depth += 1
        if _depth == 1:
            _owned = gc.get_freeze_count() == 0
            if _owned:
                gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _owned:
                gc.unfreeze()
                _owned = False
