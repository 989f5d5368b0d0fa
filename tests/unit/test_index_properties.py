"""Property: whatever batches are lost or repeated on the way, the publisher's protocol (apply;
GAP -> snapshot of the truth) leaves Redis equal to the worker's truth, on a real redis-server."""

from __future__ import annotations

import itertools

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from services.index.schema import IndexMeta, WorkerInfo
from services.index.scripts import ApplyOp, IndexScripts

META = IndexMeta("smollm2", "0123456789abcdef" * 4, 16)
HASHES = [f"{i:064x}" for i in range(6)]
_worker_ids = itertools.count()

op_strategy = st.one_of(
    st.tuples(st.sampled_from(["S", "R"]), st.sampled_from(HASHES), st.sampled_from([1, 2, 4, 3])),
    st.tuples(st.just("C"), st.just(""), st.sampled_from([1, 2, 4, 7])),
)
batch_strategy = st.tuples(st.lists(op_strategy, min_size=1, max_size=5),
                           st.sampled_from(["send", "send", "send", "drop", "twice", "replay_first"]))


@pytest.fixture(scope="module")
def scripts(module_redis_server):
    return IndexScripts(redis.Redis.from_url(module_redis_server.url), META)


def apply_to_truth(truth: dict[str, int], ops: list[ApplyOp]) -> None:
    for op, h, mask in ops:
        targets = list(truth) if op == "C" else [h]
        for target in targets:
            value = truth.get(target, 0)
            value = value | mask if op == "S" else value & ~mask
            if value:
                truth[target] = value
            else:
                truth.pop(target, None)


def stored(scripts: IndexScripts, wid: str, epoch: str) -> dict[str, int]:
    out = {}
    for h in scripts.client.smembers(META.scope + f"wb:{wid}"):
        value = scripts.client.hget(META.scope + "b:" + h.decode(), wid).decode()
        field_epoch, mask = value.rsplit(":", 1)
        assert field_epoch == epoch
        out[h.decode()] = int(mask)
    return out


def send(scripts: IndexScripts, wid: str, seq_first: int, ops: list[ApplyOp], seq_now: int,
         truth: dict[str, int]) -> str:
    status = scripts.apply(wid, "e", seq_first, ops)
    if status == "GAP":
        assert scripts.snapshot(wid, "e", seq_now, sorted(truth.items())) == "OK"
    return status


@settings(max_examples=60, deadline=None)
@given(st.lists(batch_strategy, min_size=1, max_size=12))
def test_lost_and_repeated_batches_converge_after_snapshot(scripts, batches):
    wid = f"w{next(_worker_ids)}"
    scripts.register(WorkerInfo(wid, "prefill"), "e", 60_000)
    assert scripts.snapshot(wid, "e", 0, []) == "OK"
    truth: dict[str, int] = {}
    next_seq = 1
    history: list[tuple[int, list[ApplyOp]]] = []
    is_synced = True  # no batch lost since the last snapshot: Redis must equal the truth now
    for ops, fate in batches:
        apply_to_truth(truth, ops)
        seq_first, next_seq = next_seq, next_seq + len(ops)
        history.append((seq_first, ops))
        if fate == "drop":
            is_synced = False
            continue
        status = send(scripts, wid, seq_first, ops, next_seq - 1, truth)
        assert status == ("OK" if is_synced else "GAP")
        is_synced = True
        if fate == "twice":
            assert send(scripts, wid, seq_first, ops, next_seq - 1, truth) == "DUP"
        if fate == "replay_first":  # a late duplicate of the oldest batch must change nothing
            assert send(scripts, wid, *history[0], next_seq - 1, truth) == "DUP"
        assert stored(scripts, wid, "e") == truth
    # One more (no-op) batch tells Redis how far the stream went; a gap is answered by a snapshot.
    probe: list[ApplyOp] = [("R", f"{99:064x}", 1)]
    send(scripts, wid, next_seq, probe, next_seq, truth)
    assert stored(scripts, wid, "e") == truth
    scripts.remove(wid, "e")
