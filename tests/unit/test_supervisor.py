"""``pdserve up``'s supervisor (services/launcher/supervisor.py) without a cluster: the backoff
schedule, and a child that keeps dying is restarted a bounded number of times, one log line per
death, then supervision ends with ChildFailed (``up`` exits)."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.launcher import Child, ChildFailed, RestartPolicy, Supervisor


def test_backoff_doubles_from_half_a_second_up_to_its_cap():
    policy = RestartPolicy()
    assert [policy.backoff_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_a_child_that_keeps_dying_is_restarted_max_restarts_times_then_given_up(tmp_path, capsys):
    child = Child("decode-0", ["-c", "import sys; sys.exit(3)"], "127.0.0.1:1", tmp_path / "decode-0.log")
    env = dict(os.environ)
    child.start(env)
    policy = RestartPolicy(max_restarts=2, window_s=60.0, initial_backoff_s=0.01)

    with pytest.raises(ChildFailed) as failed:
        asyncio.run(asyncio.wait_for(Supervisor([child], env, policy, startup_timeout_s=30.0).run(), 60))

    assert failed.value.child is child
    assert "decode-0 exited with code 3, its death number 3 within 60 s (at most 2 restarts)" in str(failed.value)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["pdserve up: decode-0 exited with code 3; restarting it in 0.01 s "
                     "(restart 1 of at most 2 within 60 s)",
                     "pdserve up: decode-0 exited with code 3; restarting it in 0.02 s "
                     "(restart 2 of at most 2 within 60 s)"]


def test_cancelling_the_supervisor_leaves_running_children_alone(tmp_path):
    child = Child("prefill-0", ["-c", "import time; time.sleep(60)"], "127.0.0.1:1", tmp_path / "p.log")
    env = dict(os.environ)
    child.start(env)

    async def scenario() -> None:
        task = asyncio.ensure_future(Supervisor([child], env, RestartPolicy(), 30.0).run())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(scenario())
        assert child.exit_code() is None  # stopping the children is the caller's (in order)
    finally:
        child.proc.kill()
        child.proc.wait()
