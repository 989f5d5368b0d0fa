"""Workers on the same cores split them by who is busy (engine/runner/core_share.py)."""

from __future__ import annotations

import pytest

from engine.runner import core_share
from engine.runner.core_share import GAP_NS, STALE_NS, CoreShare, create_share_file, is_busy


class Clock:
    def __init__(self) -> None:
        self.now = 10 * STALE_NS

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(core_share.time, "monotonic_ns", clock)
    return clock


def share(path, slot: int, num_threads: int = 4) -> tuple[CoreShare, list[int]]:
    calls: list[int] = []
    return CoreShare(f"{path}:{slot}", num_threads, calls.append), calls


def test_a_lone_busy_engine_keeps_every_thread(tmp_path, clock):
    path = create_share_file(tmp_path / "share", 2)
    prefill, prefill_calls = share(path, 0)
    for _ in range(3):
        prefill.step_started()
        clock.now += 5_000_000
        prefill.step_ended()
    assert prefill.threads == 4 and prefill_calls == []


def test_two_busy_engines_split_the_threads_and_take_them_back(tmp_path, clock):
    path = create_share_file(tmp_path / "share", 2)
    prefill, prefill_calls = share(path, 0)  # two maps of one file, as two processes have
    decode, decode_calls = share(path, 1)
    prefill.step_started()  # a long prefill step
    decode.step_started()
    assert decode.threads == 2 and decode_calls == [2]
    clock.now += 1_000_000
    decode.step_ended()
    decode.step_started()  # the prefill is still in its step
    assert decode_calls == [2]
    clock.now += 1_000_000
    decode.step_ended()
    prefill.step_ended()
    prefill.step_started()  # the decode engine ended a step 1 ms ago: busy (back to back)
    assert prefill.threads == 2 and prefill_calls == [2]
    prefill.step_ended()
    clock.now += GAP_NS + 1
    decode.step_started()  # the prefill engine went quiet: every thread again
    assert decode.threads == 4 and decode_calls == [2, 4]


def test_a_dead_engine_stuck_in_a_step_stops_counting(tmp_path, clock):
    path = create_share_file(tmp_path / "share", 2)
    dead, _ = share(path, 0)
    dead.step_started()  # and never ends
    live, calls = share(path, 1)
    live.step_started()
    assert live.threads == 2
    live.step_ended()
    clock.now += STALE_NS
    live.step_started()
    assert live.threads == 4 and calls == [2, 4]


def test_a_restarted_engine_clears_its_slot(tmp_path, clock):
    path = create_share_file(tmp_path / "share", 2)
    crashed, _ = share(path, 0)
    crashed.step_started()
    share(path, 0)  # the restart, on the same slot
    other, calls = share(path, 1)
    other.step_started()
    assert other.threads == 4 and calls == []


def test_busy_reads():
    now = 10 * STALE_NS
    assert not is_busy(0, 0, now)  # never stepped
    assert is_busy(now - 1, now - 2, now)  # in a step
    start = now - 2 * GAP_NS
    assert is_busy(start, now - GAP_NS + 1, now) and not is_busy(start, now - GAP_NS, now)
    assert not is_busy(now - STALE_NS, 0, now)


@pytest.mark.parametrize("spec, match", [("share", "PATH:SLOT"), ("share:x", "PATH:SLOT"),
                                         (":1", "PATH:SLOT"), ("{path}:2", "slot 2 is not in")])
def test_a_bad_spec_names_what_is_wrong(tmp_path, spec, match):
    path = create_share_file(tmp_path / "share", 2)
    with pytest.raises(ValueError, match=match):
        CoreShare(spec.format(path=path), 2, lambda threads: None)


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        CoreShare(f"{tmp_path / 'none'}:0", 2, lambda threads: None)


def _share_specs(argv: list[str], tmp_path) -> list[str]:
    from engine.config import Role
    from services import launcher
    from services.worker.settings import worker_parser

    workers, _ = launcher.plan(launcher.build_parser().parse_args(argv), tmp_path)
    specs = []
    for worker in workers:
        serve = worker.argv.index("serve")
        specs.append(worker_parser(Role(worker.argv[serve + 1]), 0).parse_args(worker.argv[serve + 2:]).core_share)
    return specs


def test_up_gives_workers_on_shared_cores_a_slot_each(tmp_path):
    specs = _share_specs(["--prefill", "1", "--decode", "2"], tmp_path)
    assert specs == [f"{tmp_path / 'core-share'}:{slot}" for slot in range(3)]
    for spec in specs:  # every slot opens
        CoreShare(spec, 2, lambda threads: None)


@pytest.mark.parametrize("argv", [["--pin-cores"], ["--colocated"], ["--device", "cuda"]])
def test_pinned_colocated_or_cuda_workers_share_nothing(tmp_path, argv):
    from services import launcher

    workers, router = launcher.plan(launcher.build_parser().parse_args(argv), tmp_path)
    assert all("--core-share" not in child.argv for child in [*workers, router])
    assert not (tmp_path / "core-share").exists()
