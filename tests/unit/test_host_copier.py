"""The background copier (engine/kv_cache/tiers/copier.py): jobs in submission order on one thread that
starts with the first job, waits that say whether they blocked, errors handed back, a close that
finishes the queue, and no CPU at rest."""

from __future__ import annotations

import threading
import time

import pytest

from engine.kv_cache.tiers.copier import BackgroundCopier, InlineCopier


@pytest.fixture
def copier():
    copier = BackgroundCopier(name="test-copier")
    yield copier
    copier.close()


def test_jobs_run_in_order_and_wait_blocks_until_done(copier):
    gate = threading.Event()
    ran: list[int] = []

    def job(i: int):
        def fn() -> int:
            if i == 0:
                assert gate.wait(5)
            ran.append(i)
            return i * 10
        return fn

    jobs = [copier.submit(job(i)) for i in range(3)]
    assert not any(j.is_done for j in jobs)  # the first holds the line
    gate.set()
    assert copier.wait(jobs[2]) is True
    assert ran == [0, 1, 2] and [j.result for j in jobs] == [0, 10, 20] and all(j.is_done for j in jobs)
    assert copier.wait(jobs[0]) is False  # done already: no wait
    assert all(j.seconds >= 0 and j.error is None for j in jobs)


def test_an_exception_is_handed_back_and_the_thread_goes_on(copier):
    def broken() -> int:
        raise ValueError("bad job")

    bad, good = copier.submit(broken), copier.submit(lambda: 7)
    copier.wait(good)
    assert isinstance(bad.error, ValueError) and good.result == 7 and good.error is None


def test_the_thread_starts_with_the_first_job_and_close_finishes_the_queue():
    copier = BackgroundCopier(name="test-copier-lazy")
    assert not [t for t in threading.enumerate() if t.name == "test-copier-lazy"]
    gate = threading.Event()
    first = copier.submit(lambda: int(gate.wait(5)))
    second = copier.submit(lambda: 2)
    gate.set()
    copier.close()
    assert first.is_done and second.result == 2
    assert not [t for t in threading.enumerate() if t.name == "test-copier-lazy"]
    with pytest.raises(RuntimeError, match="closed copier"):
        copier.submit(lambda: 0)
    copier.close()  # idempotent


def test_a_stuck_job_is_an_error_after_the_limit(copier):
    gate = threading.Event()
    job = copier.submit(lambda: int(gate.wait(5)))
    with pytest.raises(RuntimeError, match="did not finish within 0.05 s"):
        copier.wait(job, timeout_s=0.05)
    gate.set()
    copier.wait(job)


def test_an_idle_copier_uses_no_cpu(copier):
    copier.wait(copier.submit(lambda: 0))
    thread = next(t for t in threading.enumerate() if t.name == "test-copier")
    before = _cpu_ticks(thread.native_id)
    time.sleep(0.5)
    assert _cpu_ticks(thread.native_id) - before <= 1  # asleep on its condition, not polling


def test_the_inline_copier_runs_at_submit():
    copier = InlineCopier()
    job = copier.submit(lambda: 3)
    assert job.is_done and job.result == 3 and copier.wait(job) is False


def _cpu_ticks(native_id: int | None) -> int:
    """User + system clock ticks of one thread of this process (Linux)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the whole line)
