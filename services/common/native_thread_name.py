"""Give the calling thread its name at the OS level too.

Python before 3.14 names threads only for itself: to ``top -H``, ``perf`` and
``/proc/<pid>/task/<tid>/comm`` every thread of a service is "python". The threads that carry a
service's work name themselves here, so that their CPU time can be read from outside without a
profiler (``loadtests/cluster.py: host_cpu``). Linux only (prctl PR_SET_NAME, 15 bytes kept);
elsewhere, or if libc refuses, nothing happens.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15


def set_native_thread_name(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
