"""engine/heap.py: what is frozen out of garbage collection, and when it comes back."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest

from engine import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _unfrozen():
    assert gc.get_freeze_count() == 0, "the test process must start unfrozen"
    yield
    heap.thaw()


def _cyclic_garbage() -> weakref.ref[_Node]:
    return weakref.ref(_Node())  # unreachable at once, but alive until a collection finds it


def test_frozen_during_keeps_old_garbage_until_it_ends_and_then_gives_it_back():
    old = _cyclic_garbage()
    with heap.frozen_during():
        assert gc.get_freeze_count() > 0
        new = _cyclic_garbage()
        gc.collect()
        assert old() is not None  # frozen: not walked
        assert new() is None  # made during the call: collected as always
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None


def test_nested_and_overlapping_calls_unfreeze_when_the_last_one_ends():
    first, second = heap.frozen_during(), heap.frozen_during()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # overlapping, as two threads' calls would
    assert gc.get_freeze_count() > 0
    second.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0
    with heap.frozen_during(), heap.frozen_during():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_before_stays_frozen():
    assert heap.freeze_long_lived("test") > 0
    old = _cyclic_garbage()
    gc.freeze()  # (counts can drop meanwhile: reference counting still frees frozen objects)
    with heap.frozen_during():
        pass
    gc.collect()
    assert old() is not None  # still frozen
    heap.thaw()
    gc.freeze()  # the caller's own freeze is not ours to undo either
    with contextlib.suppress(RuntimeError), heap.frozen_during():
        raise RuntimeError("an error inside leaves the state as it found it")
    gc.collect()
    assert old() is not None
    gc.unfreeze()
    gc.collect()
    assert old() is None


def test_freeze_long_lived_collects_first_and_thaw_gives_everything_back():
    garbage = _cyclic_garbage()
    heap.freeze_long_lived("test")
    assert garbage() is None  # collected, not frozen
    kept = _Node()
    ref = weakref.ref(kept)
    heap.freeze_long_lived("test")
    del kept
    gc.collect()
    assert ref() is not None
    heap.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_llm_generate_runs_on_a_frozen_heap_and_leaves_it_unfrozen(loaded_model):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(loaded_model, num_kv_blocks=32)
    seen = []
    step = llm.engine.step

    def counting_step():
        seen.append(gc.get_freeze_count())
        return step()

    llm.engine.step = counting_step
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0


def test_collector_pauses_records_each_collection_only_while_recording():
    from loadtests.bench_gc import CollectorPauses

    pauses = CollectorPauses()
    with pauses.recording():
        gc.collect()
        gc.collect(0)
    gc.collect()  # not recorded
    summary = pauses.summary()
    assert (summary["gen2_n"], summary["gen0_n"]) == (1, 1)
    assert summary["total_ms"] >= summary["gen2_max_ms"] > 0
    assert summary["longest_ms"] >= summary["gen2_max_ms"]
    assert pauses._callback not in gc.callbacks
