"""The per-process collector log behind docs/cpu/gc_pauses_s15.txt (the served runs).

Saved as ``sitecustomize.py`` in a directory DIR, ``PYTHONPATH=DIR GCSTAT=1 pdserve up ...``
makes every process write ``/tmp/gcstat/<pid>.txt`` each second: its argv, then one line per
collection, ``epoch generation seconds collected``.
"""

import gc
import os
import sys
import threading
import time

_events: list[tuple[float, int, float, int]] = []
_started = [0.0]


def _callback(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _events.append((time.time(), info["generation"], time.perf_counter() - _started[0],
                        info["collected"]))


def _dump() -> None:
    os.makedirs("/tmp/gcstat", exist_ok=True)
    while True:
        time.sleep(1.0)
        with open(f"/tmp/gcstat/{os.getpid()}.txt", "w") as out:
            out.write(" ".join(sys.argv[:3]) + "\n")
            out.writelines(f"{t:.3f} {g} {s:.5f} {n}\n" for t, g, s, n in list(_events))


if os.environ.get("GCSTAT"):
    gc.callbacks.append(_callback)
    threading.Thread(target=_dump, daemon=True).start()
