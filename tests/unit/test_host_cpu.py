"""Per-thread CPU from outside the process: the engine thread names itself for the OS
(services/common/native_thread_name.py) and loadtests/cluster.py's host_cpu reads each process's
main thread, engine thread and total from /proc, as bench_serve does around a load."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from loadtests.cluster import ENGINE_THREAD, host_cpu, host_cpu_by_role
from services.common.async_engine import ENGINE_THREAD_NAME
from services.common.native_thread_name import set_native_thread_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_engine_thread_is_named_for_the_os_and_its_cpu_read_apart():
    assert ENGINE_THREAD == ENGINE_THREAD_NAME
    named = threading.Event()

    def engine() -> None:
        set_native_thread_name(ENGINE_THREAD_NAME)
        named.set()
        spin(0.3)

    before = host_cpu(os.getpid())
    thread = threading.Thread(target=engine)
    thread.start()
    assert named.wait(10)
    with open(f"/proc/{os.getpid()}/task/{thread.native_id}/comm") as f:
        assert f.read().strip() == ENGINE_THREAD_NAME
    thread.join()
    spin(0.1)  # the main thread's own share
    # the thread has ended: its time is the process's still, no longer its own task's
    used = host_cpu(os.getpid())[os.getpid()].minus(before[os.getpid()])
    assert used.total_s >= 0.35 and 0.05 <= used.main_s < 0.3


def test_a_live_engine_thread_and_a_child_process_by_role():
    spun, stop = threading.Event(), threading.Event()

    def engine() -> None:
        set_native_thread_name(ENGINE_THREAD_NAME)
        spin(0.3)
        spun.set()
        stop.wait(30)  # alive, idle: its task is still there to be read

    before = host_cpu(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                              "while time.process_time() < end: pass\nprint('spun', flush=True)\n"
                              "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        assert spun.wait(30)
        after = host_cpu(os.getpid())
    finally:
        stop.set()
        child.kill()
        child.wait()
        thread.join()
    own = after[os.getpid()].minus(before[os.getpid()])
    assert own.engine_s >= 0.28 and own.main_s < 0.2  # the main thread waited
    assert after[child.pid].role == "other" and after[child.pid].total_s >= 0.28
    by_role = host_cpu_by_role(before, after)
    assert by_role["other"].total_s >= own.total_s + 0.28  # this process and the child, summed
