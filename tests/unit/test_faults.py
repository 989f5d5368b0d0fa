"""The fault-injection spec (services/common/faults.py): every entry parsed, bad ones named, and
every hook inert without PDSERVE_FAULTS; a kill fault really SIGKILLs its process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.faults import FAULTS_ENV, FaultPlan, Faults, parse_faults

REPO = Path(__file__).resolve().parents[2]


def test_parse_every_entry():
    plan = parse_faults("kv_transfer:drop:0.5, kv_transfer:corrupt:0.25,kv_transfer:delay_ms:30,"
                        "kill:decode:after_tokens=5,kill:prefill:before_first_token=2,"
                        "redis:stall_ms=200,kill:kvstore:at_release=3,kvstore:progress_delay_ms=70,seed=9")
    assert plan == FaultPlan(kv_drop_p=0.5, kv_corrupt_p=0.25, kv_delay_ms=30.0,
                             kill_decode_after_tokens=5, kill_prefill_before_first_token=2,
                             redis_stall_ms=200.0, kill_kvstore_at_release=3,
                             kvstore_progress_delay_ms=70.0, seed=9)
    assert plan.is_active
    assert parse_faults("") == FaultPlan() and not parse_faults(" , ").is_active
    assert not parse_faults("seed=3").is_active
    assert parse_faults("redis:stall_ms:50").redis_stall_ms == 50.0  # ':' or '=' before the value


@pytest.mark.parametrize("spec,message", [
    ("kv_transfer:explode:1", "unknown fault 'kv_transfer:explode:1'"),
    ("nonsense", "unknown fault 'nonsense'"),
    ("kv_transfer:drop:1.5", "a probability must be in [0, 1]"),
    ("kv_transfer:drop:x", "'x' is not a number"),
    ("kill:decode:after_tokens=0", "a count must be >= 1"),
    ("kill:decode:after_tokens=2.5", "'2.5' is not a number"),
    ("redis:stall_ms=-1", "ms must be in [0, 60000]"),
    ("seed=1,seed=2", "'seed' given twice"),
])
def test_bad_specs_name_the_entry(spec, message):
    with pytest.raises(ValueError, match=FAULTS_ENV) as err:
        parse_faults(spec)
    assert message in str(err.value)


def test_hooks_are_inert_without_faults():
    hooks = Faults(parse_faults(""))
    data = b"\x01\x02\x03" * 1000
    started = time.monotonic()
    for _ in range(1000):
        assert hooks.kv_send_dropped() is False
        assert hooks.kv_corrupted(data) is data
        hooks.after_decode_tokens(10**6)  # would SIGKILL this process were it on
        hooks.before_first_token()
        hooks.redis_stall()
    assert time.monotonic() - started < 1.0


def test_process_without_the_variable_has_no_faults():
    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
    probe = subprocess.run(
        [sys.executable, "-c", "from services.common.faults import faults; "
                               "print(faults().plan.is_active)"],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stderr


def test_drop_and_corrupt_follow_their_probability_and_seed():
    hooks = Faults(parse_faults("kv_transfer:drop:0.5,kv_transfer:corrupt:1,seed=4"))
    drops = [hooks.kv_send_dropped() for _ in range(400)]
    assert 150 < sum(drops) < 250
    again = Faults(parse_faults("kv_transfer:drop:0.5,kv_transfer:corrupt:1,seed=4"))
    assert [again.kv_send_dropped() for _ in range(400)] == drops
    data = bytes(64)
    corrupted = hooks.kv_corrupted(data)
    assert len(corrupted) == 64 and sum(a != b for a, b in zip(data, corrupted)) == 1


def test_kill_fault_sigkills_at_the_chosen_point():
    script = ("from services.common.faults import faults\n"
              "f = faults()\n"
              "f.after_decode_tokens(2); print('alive at 2', flush=True)\n"
              "f.after_decode_tokens(3); print('alive at 3', flush=True)\n")
    probe = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO),
                                FAULTS_ENV: "kill:decode:after_tokens=3"}, timeout=60)
    assert probe.returncode == -signal.SIGKILL
    assert probe.stdout == "alive at 2\n"
