"""The CPU kernels' build lock (kernels/cpu/__init__.py, ``_build_lock``): a builder killed mid-build
must not make every later load wait (torch's lock file outlives its holder; the flock does not)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from kernels.cpu import _build_lock

HOLD = """
import fcntl, sys, time
guard = open(sys.argv[1] + "/pdserve.lock", "a")
fcntl.flock(guard, fcntl.LOCK_EX)
open(sys.argv[1] + "/lock", "w").close()  # as torch's baton, mid-build
print("held", flush=True)
time.sleep(60)
"""


def test_a_dead_builders_torch_lock_is_removed(tmp_path):
    (tmp_path / "lock").touch()  # left by a builder that was killed: fresh, so no age tells
    with _build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_builder_is_waited_for_and_its_death_frees_the_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def build() -> None:
            with _build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=build)
        waiter.start()
        assert not entered.wait(0.5), "entered while another process builds"
        assert (tmp_path / "lock").exists()
        holder.send_signal(signal.SIGKILL)  # killed mid-build: its torch lock file stays
        started = time.monotonic()
        assert entered.wait(10), "a dead builder's lock still blocks"
        waiter.join()
        assert time.monotonic() - started < 10 and not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
