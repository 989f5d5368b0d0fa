"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption, admission limits, abort,
the PREFILL / DECODE roles and n > 1 forks, over a real KVCacheManager and BlockPool.

The model is a stand-in (``FakeRunner``): it checks every request reads back its own tokens
from the KV slots and "samples" 100 + 10 * sample index + output position. Block size 4.
"""

from __future__ import annotations

import pytest

from engine.config import Role
from engine.request import RequestStatus
from tests.unit._scheduler_fakes import (
    FakeRunner,
    check_scheduler,
    make_request,
    make_scheduler,
    run_until_idle,
)


@pytest.fixture
def new_scheduler():
    """``new_scheduler(**config)`` -> (scheduler, runner); every one is checked after the test."""
    made = []

    def new(**config):
        scheduler = make_scheduler(**config)
        made.append(scheduler)
        return scheduler, FakeRunner(scheduler)

    yield new
    for scheduler in made:
        check_scheduler(scheduler)


def scheduled(sched) -> dict[str, int]:
    return dict(sched.num_scheduled_tokens)


def new_tokens(outputs) -> dict[str, list[int]]:
    return {o.request_id: o.new_token_ids for o in outputs}


def all_blocks_free(scheduler) -> bool:
    pool = scheduler.kv_manager.block_pool
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def add_parallel(scheduler, request_id: str, prompt, n: int, **kwargs):
    """What EngineCore does for n > 1: sample 0 is queued, samples 1.. fork from it."""
    samples = [make_request(f"{request_id}/{i}", prompt, index=i, parent_id=request_id, **kwargs)
               for i in range(n)]
    scheduler.add_request(samples[0])
    for sample in samples[1:]:
        scheduler.add_request(sample, fork_from=samples[0].request_id)
    return samples


def test_decodes_first_then_a_long_prompt_is_chunked_into_the_rest(new_scheduler):
    scheduler, runner = new_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 3, max_tokens=10))
    scheduler.add_request(make_request("b", 2, max_tokens=10))
    sched, outputs = runner.step()
    assert scheduled(sched) == {"a": 3, "b": 2}
    assert new_tokens(outputs) == {"a": [100], "b": [100]}

    scheduler.add_request(make_request("long", 17, max_tokens=2))
    steps = [runner.step() for _ in range(4)]
    assert [scheduled(s) for s, _ in steps] == [
        {"a": 1, "b": 1, "long": 6},
        {"a": 1, "b": 1, "long": 6},
        {"a": 1, "b": 1, "long": 5},  # the last chunk: 6 + 6 + 5 = 17
        {"a": 1, "b": 1, "long": 1},
    ]
    assert [new_tokens(o) for _, o in steps] == [
        {"a": [101], "b": [101]},
        {"a": [102], "b": [102]},
        {"a": [103], "b": [103], "long": [100]},
        {"a": [104], "b": [104], "long": [101]},
    ]
    assert all(s.total_num_scheduled_tokens <= 8 for s, _ in steps)
    assert scheduler.requests.keys() == {"a", "b"}  # long finished (max_tokens=2)


def test_a_decode_behind_a_prefilling_request_still_gets_its_token(new_scheduler):
    # The forked sample "p/1" joins the running list after "long", which is mid-prefill: it must
    # still get its token every step, and "long" takes what is left of the budget.
    scheduler, runner = new_scheduler(max_num_batched_tokens=8)
    add_parallel(scheduler, "p", 3, n=2, max_tokens=10)
    scheduler.add_request(make_request("long", 20, max_tokens=2))
    sched, outputs = runner.step()
    assert scheduled(sched) == {"p/0": 3, "long": 5, "p/1": 0}
    assert new_tokens(outputs) == {"p/0": [100], "p/1": [110]}
    assert [r.request_id for r in scheduler.running] == ["p/0", "long", "p/1"]

    steps = [runner.step() for _ in range(3)]
    assert [scheduled(s) for s, _ in steps] == [
        {"p/0": 1, "p/1": 1, "long": 6},
        {"p/0": 1, "p/1": 1, "long": 6},
        {"p/0": 1, "p/1": 1, "long": 3},
    ]
    assert [new_tokens(o) for _, o in steps] == [
        {"p/0": [101], "p/1": [111]},
        {"p/0": [102], "p/1": [112]},
        {"p/0": [103], "p/1": [113], "long": [100]},
    ]


def test_long_prefill_token_threshold_caps_every_chunk(new_scheduler):
    scheduler, runner = new_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=4)
    scheduler.add_request(make_request("x", 10, max_tokens=1))
    scheduler.add_request(make_request("y", 10, max_tokens=1))
    scheduler.add_request(make_request("z", 10, max_tokens=1))
    assert [scheduled(runner.step()[0]) for _ in range(4)] == [
        {"x": 4, "y": 4, "z": 4},
        {"x": 4, "y": 4, "z": 4},
        {"x": 2, "y": 2, "z": 2},
        {},
    ]
    assert not scheduler.has_unfinished_requests()


def test_the_budget_is_never_exceeded_when_decodes_alone_fill_it(new_scheduler):
    scheduler, runner = new_scheduler(max_num_batched_tokens=3)
    for rid in "abcd":
        scheduler.add_request(make_request(rid, 1, max_tokens=3))
    assert [scheduled(runner.step()[0]) for _ in range(5)] == [
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "b": 1, "c": 1},  # a, b, c finish (3 tokens)
        {"d": 1},
        {"d": 1},
    ]


def test_max_num_seqs_limits_the_running_batch(new_scheduler):
    scheduler, runner = new_scheduler(max_num_seqs=2)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 2, max_tokens=2))
    sched, _ = runner.step()
    assert scheduled(sched) == {"a": 2, "b": 2}
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    sched, outputs = runner.step()
    assert scheduled(sched) == {"a": 1, "b": 1}  # c is not admitted while both still run
    assert all(o.finished for o in outputs)
    assert scheduled(runner.step()[0]) == {"c": 2}


def test_preemption_evicts_the_newest_request_to_the_front_of_the_queue(new_scheduler):
    # 6 blocks of 4: a, b and c (4-token prompts) fill them at 8 tokens each; the 9th needs a
    # third block each.
    scheduler, runner = new_scheduler(num_blocks=6)
    for rid in "abc":
        scheduler.add_request(make_request(rid, [1, 2, 3, 4], max_tokens=8))
    runner.step()
    scheduler.add_request(make_request("d", [9, 9, 9, 9], max_tokens=1))
    for _ in range(4):
        assert scheduled(runner.step()[0]) == {"a": 1, "b": 1, "c": 1}  # d does not fit
    assert scheduler.kv_manager.num_free_blocks == 0
    c = scheduler.requests["c"]
    c_tokens = c.all_token_ids
    assert c_tokens == [1, 2, 3, 4, 100, 101, 102, 103, 104]

    sched, outputs = runner.step()
    assert sched.preempted_ids == ["c"]
    assert scheduled(sched) == {"a": 1, "b": 1}  # and no admission in a step that preempted
    assert new_tokens(outputs) == {"a": [105], "b": [105]}
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.all_token_ids == c_tokens and c.num_preemptions == 1
    assert scheduler.kv_manager.get_block_ids("c") == []
    assert scheduler.num_preemptions == 1
    check_scheduler(scheduler)

    outputs = run_until_idle(runner)
    finals = {o.request_id: o for o in outputs if o.finished}
    assert finals.keys() == {"a", "b", "c", "d"}
    # c is recomputed from all its 9 tokens and goes on where it stopped.
    assert c.output_token_ids == list(range(100, 108))
    assert all_blocks_free(scheduler)


def test_a_running_request_preempts_itself_when_it_is_the_newest(new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=2)
    scheduler.add_request(make_request("a", 4, max_tokens=4))  # needs 2 blocks at its 5th token
    scheduler.add_request(make_request("b", 4, max_tokens=4))
    assert scheduled(runner.step()[0]) == {"a": 4, "b": 4}
    sched, _ = runner.step()
    assert sched.preempted_ids == ["b"] and scheduled(sched) == {"a": 1}
    run_until_idle(runner)
    assert scheduler.num_preemptions == 1
    assert all_blocks_free(scheduler)


def test_a_request_that_can_never_fit_is_rejected_when_added(new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=4)  # 16 tokens in all
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(make_request("big", 10, max_tokens=7))
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(make_request("huge", 17, max_tokens=1))
    # max_tokens=None runs to the context (128 tokens here): it can never fit either.
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(make_request("unbounded", 4, max_tokens=None))
    assert not scheduler.has_unfinished_requests() and not scheduler.waiting

    scheduler.add_request(make_request("fits", 10, max_tokens=6))
    run_until_idle(runner)
    assert all_blocks_free(scheduler)


def test_max_tokens_none_fits_when_the_context_fits(new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=4, max_model_len=16)
    scheduler.add_request(make_request("a", 10, max_tokens=None))
    outputs = run_until_idle(runner)
    assert outputs[-1].finish_reason == "length"
    assert scheduler.kv_manager.block_pool.num_free_blocks == 4


def test_a_duplicate_request_id_is_rejected(new_scheduler):
    scheduler, _ = new_scheduler()
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", 3))
    scheduler.abort_request("a")


def _into_state(state: str, new_scheduler):
    """A scheduler with request "x" in ``state`` and "other" running beside it."""
    role = {"remote_kv": Role.DECODE, "remote_kv_landed": Role.DECODE, "held": Role.PREFILL}
    scheduler, runner = new_scheduler(num_blocks=6, max_num_batched_tokens=8,
                                      role=role.get(state, Role.COLOCATED))
    if state != "held":
        scheduler.add_request(make_request("other", 3, max_tokens=20))
        runner.step()
    if state == "waiting":
        scheduler.add_request(make_request("x", 20, max_tokens=2))  # does not fit beside other
        runner.step()
    elif state == "prefilling":
        scheduler.add_request(make_request("x", 12, max_tokens=2))
        runner.step()  # a 7-token chunk
        assert 0 < scheduler.requests["x"].num_computed_tokens < 12
    elif state == "decoding":
        scheduler.add_request(make_request("x", 3, max_tokens=5))
        runner.step()
        runner.step()
    elif state == "preempted":
        scheduler.add_request(make_request("x", 8, max_tokens=8))
        for _ in range(10):
            if scheduler.num_preemptions:
                break
            runner.step()
        assert scheduler.requests["x"].status == RequestStatus.PREEMPTED
    elif state in ("fork_pending", "forked"):
        add_parallel(scheduler, "x", 10, n=2, max_tokens=4)
        runner.step()  # sample 0's first chunk: sample 1 still waits for the fork
        if state == "forked":
            runner.step()
            assert scheduler.requests["x/1"].status == RequestStatus.RUNNING
    elif state in ("remote_kv", "remote_kv_landed"):
        assert scheduler.reserve_remote(make_request("x", 6, max_tokens=4)) is not None
        if state == "remote_kv_landed":
            scheduler.finish_remote_kv("x", 7)
    elif state == "held":
        scheduler.add_request(make_request("x", 6, max_tokens=4))
        runner.step()
        assert "x" in scheduler.held
    return scheduler, runner


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted",
                                   "fork_pending", "forked", "remote_kv", "remote_kv_landed",
                                   "held"])
def test_abort_frees_the_blocks_in_every_state(state, new_scheduler):
    scheduler, runner = _into_state(state, new_scheduler)
    ids = [i for i in ("x", "x/0", "x/1") if i in scheduler.requests or i in scheduler.held]
    assert ids
    for request_id in ids:
        output = scheduler.abort_request(request_id)
        if state == "held":
            assert output is None
        else:
            assert output.finished and output.finish_reason == "abort"
        assert scheduler.kv_manager.get_block_ids(request_id) == []
    check_scheduler(scheduler)
    assert not any(i.startswith("x") for i in scheduler.requests)
    assert scheduler.abort_request("x") is None  # aborting twice is a no-op
    if scheduler.config.role == Role.COLOCATED:
        run_until_idle(runner)
    else:
        scheduler.abort_request("other")
    assert all_blocks_free(scheduler)


def test_a_parent_finished_before_its_fork_hands_its_samples_back(new_scheduler):
    # Only sample 0 is aborted (e.g. a client cancelled one choice): sample 1 must not be
    # stranded waiting for a fork that will never come.
    scheduler, runner = new_scheduler(max_num_batched_tokens=4)
    add_parallel(scheduler, "x", 10, n=2, max_tokens=3)
    runner.step()
    scheduler.abort_request("x/0")
    outputs = run_until_idle(runner, max_steps=20)
    assert [o.new_token_ids for o in outputs if o.request_id == "x/1"] == [[110], [111], [112]]
    assert all_blocks_free(scheduler)


@pytest.mark.parametrize("params, reason, stop_reason", [
    ({"eos_token_ids": (100,)}, "stop", None),       # the first token is EOS
    ({"stop_token_ids": [100]}, "stop", 100),        # ... or a stop token
    ({"max_tokens": 1}, "length", None),             # ... or the last one allowed
])
def test_a_first_token_that_ends_the_request_is_its_real_finish_and_frees_the_blocks(
        new_scheduler, params, reason, stop_reason):
    """PREFILL role: nothing goes on on a decode worker, so the request is not held."""
    scheduler, runner = new_scheduler(num_blocks=8, max_num_batched_tokens=16, role=Role.PREFILL)
    scheduler.add_request(make_request("x", 10, **{"max_tokens": 16, **params}))
    _, outputs = runner.step()
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs] == [
        ([100], reason, stop_reason)]
    assert not scheduler.held and all_blocks_free(scheduler)


def test_prefill_role_stops_after_the_first_token_and_holds_the_blocks(new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=8, max_num_batched_tokens=8, role=Role.PREFILL)
    scheduler.add_request(make_request("x", 10, max_tokens=16))
    sched, outputs = runner.step()
    assert scheduled(sched) == {"x": 8}
    # A chunk without a token still reports progress: what can already be sent.
    assert [(o.new_token_ids, o.num_computed_tokens, o.finished) for o in outputs] == [
        ([], 8, False)]
    sched, outputs = runner.step()
    assert scheduled(sched) == {"x": 2}
    assert [(o.new_token_ids, o.num_computed_tokens, o.finish_reason) for o in outputs] == [
        ([100], 10, "prefilled")]
    assert not scheduler.has_unfinished_requests() and scheduler.schedule().is_empty
    assert scheduler.held.keys() == {"x"}
    assert scheduler.kv_manager.get_block_ids("x") == [0, 1, 2]
    assert scheduler.kv_manager.num_free_blocks == 5
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("x", 3))

    scheduler.release_held("x")
    assert not scheduler.held and all_blocks_free(scheduler)


def test_decode_role_reserves_blocks_and_decodes_once_the_kv_has_landed(new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=4, role=Role.DECODE)
    prompt = [5, 6, 7, 8, 9, 10]
    assert scheduler.reserve_remote(make_request("x", prompt, max_tokens=3)) == [0, 1]
    # Nothing to do until the KV lands; the blocks stay reserved.
    assert scheduler.schedule().is_empty
    assert scheduler.kv_manager.num_free_blocks == 2
    # A second prompt of 12 tokens does not fit beside it: None, and nothing changes.
    assert scheduler.reserve_remote(make_request("y", 12, max_tokens=2)) is None
    assert "y" not in scheduler.requests and scheduler.kv_manager.num_free_blocks == 2
    with pytest.raises(ValueError, match="already in use"):
        scheduler.reserve_remote(make_request("x", prompt))
    with pytest.raises(ValueError, match="fit|max_tokens"):
        scheduler.reserve_remote(make_request("z", 12, max_tokens=8))  # never fits in 16 slots

    runner.slots[:6] = prompt  # the prefill worker wrote the prompt's KV into blocks 0 and 1
    scheduler.finish_remote_kv("x", 42)
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        scheduler.finish_remote_kv("x", 42)
    sched, outputs = runner.step()
    assert scheduled(sched) == {"x": 1}  # only the first token: the prompt was not recomputed
    assert sched.scheduled[0].num_computed_tokens == 7
    assert new_tokens(outputs) == {"x": [101]}  # output position 1 (42 was position 0)
    assert outputs[0].finish_reason is None
    sched, outputs = runner.step()
    assert new_tokens(outputs) == {"x": [102]} and outputs[0].finish_reason == "length"
    assert all_blocks_free(scheduler)


@pytest.mark.parametrize("max_tokens, first_token, reason", [(1, 42, "length"), (5, 2, "stop")])
def test_decode_role_finishes_at_once_when_the_first_token_ends_the_request(
        max_tokens, first_token, reason, new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=4, role=Role.DECODE)
    scheduler.reserve_remote(make_request("x", 6, max_tokens=max_tokens, eos_token_ids=(2,)))
    output = scheduler.finish_remote_kv("x", first_token)
    assert output is not None and output.finished and output.finish_reason == reason
    assert not scheduler.has_unfinished_requests() and runner.step()[0].is_empty
    assert all_blocks_free(scheduler)


def _land(scheduler, runner, request_id, first_token):
    """The prefill worker wrote the prompt's KV into the reserved blocks and sampled a token."""
    request = scheduler.requests[request_id]
    block_ids, bs = scheduler.kv_manager.get_block_ids(request_id), scheduler.block_size
    for pos, token in enumerate(request.prompt_token_ids):
        runner.slots[block_ids[pos // bs] * bs + pos % bs] = token
    assert scheduler.finish_remote_kv(request_id, first_token) is None


def test_landed_kv_waiting_for_a_seat_gives_its_blocks_to_the_running_request(new_scheduler):
    # x runs alone (one seat); y's landed KV fills the rest of the pool. When x needs a block,
    # y gives its blocks up (to be recomputed) rather than x preempting itself for ever.
    scheduler, runner = new_scheduler(num_blocks=3, block_size=2, max_num_seqs=1,
                                      role=Role.DECODE)
    scheduler.reserve_remote(make_request("x", [7], max_tokens=3))
    scheduler.reserve_remote(make_request("y", [8, 8, 8], max_tokens=2))
    assert scheduler.kv_manager.num_free_blocks == 0
    _land(scheduler, runner, "x", 50)
    _land(scheduler, runner, "y", 60)
    assert scheduled(runner.step()[0]) == {"x": 1}
    sched, outputs = runner.step()  # x's 3rd token needs a second block
    assert scheduled(sched) == {"x": 1} and new_tokens(outputs) == {"x": [102]}
    y = scheduler.requests["y"]
    assert y.status == RequestStatus.PREEMPTED and y.num_computed_tokens == 0
    assert scheduler.kv_manager.get_block_ids("y") == [] and scheduler.num_preemptions == 1
    outputs = run_until_idle(runner, max_steps=20)
    assert [o.new_token_ids for o in outputs if o.request_id == "y"] == [[101]]  # after 60
    assert all_blocks_free(scheduler)


def test_landed_kv_queued_behind_gives_its_blocks_to_the_queue_head(new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=2, block_size=2, role=Role.DECODE)
    scheduler.reserve_remote(make_request("x", [7, 7], max_tokens=2))
    scheduler.reserve_remote(make_request("y", [8, 8], max_tokens=2))
    _land(scheduler, runner, "x", 50)
    _land(scheduler, runner, "y", 60)
    # x's first decode needs a second block; nothing runs that would free one: y gives its up.
    sched, outputs = runner.step()
    assert scheduled(sched) == {"x": 1} and new_tokens(outputs) == {"x": [101]}
    assert scheduler.requests["y"].status == RequestStatus.PREEMPTED
    run_until_idle(runner, max_steps=20)
    assert all_blocks_free(scheduler)


def test_parallel_samples_fork_from_sample_0_after_its_prefill(new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=8, max_num_batched_tokens=4)
    add_parallel(scheduler, "p", 6, n=3, max_tokens=3)
    sched, outputs = runner.step()
    assert scheduled(sched) == {"p/0": 4} and not sched.fork_children and not outputs
    assert [r.request_id for r in scheduler.running] == ["p/0"]

    sched, outputs = runner.step()  # the last chunk: samples 1 and 2 join
    assert scheduled(sched) == {"p/0": 2, "p/1": 0, "p/2": 0}
    assert new_tokens(outputs) == {"p/0": [100], "p/1": [110], "p/2": [120]}
    assert [r.request_id for r in scheduler.running] == ["p/0", "p/1", "p/2"]
    manager = scheduler.kv_manager
    assert [manager.get_block_ids(f"p/{i}") for i in range(3)] == [[0, 1]] * 3
    assert [b.ref_cnt for b in manager.block_pool.blocks[:3]] == [3, 3, 0]
    assert manager.num_free_blocks == 6
    assert all(r.num_computed_tokens == 6 for r in scheduler.running)

    # Each writes position 6, in the shared half-full block 1: the first two copy it, the last
    # is then its only owner and writes in place. Full block 0 stays shared.
    sched, outputs = runner.step()
    assert scheduled(sched) == {"p/0": 1, "p/1": 1, "p/2": 1}
    assert sched.copy_ops == [(1, 2), (1, 3)]
    assert [manager.get_block_ids(f"p/{i}") for i in range(3)] == [[0, 2], [0, 3], [0, 1]]
    assert new_tokens(outputs) == {"p/0": [101], "p/1": [111], "p/2": [121]}
    outputs = run_until_idle(runner)
    assert sorted(new_tokens(outputs).items()) == [("p/0", [102]), ("p/1", [112]), ("p/2", [122])]
    assert all_blocks_free(scheduler)


def test_parallel_samples_of_one_token_finish_with_their_parent(new_scheduler):
    scheduler, runner = new_scheduler()
    add_parallel(scheduler, "p", 6, n=3, max_tokens=1)
    _, outputs = runner.step()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("p/0", [100], "length"), ("p/1", [110], "length"), ("p/2", [120], "length")]
    assert not scheduler.has_unfinished_requests() and all_blocks_free(scheduler)


def test_forked_samples_respect_max_num_seqs(new_scheduler):
    # Only one seat is left after sample 0: sample 1 forks into it, sample 2 waits at the front
    # of the queue and computes its prompt itself (a prefix hit on sample 0's full block).
    scheduler, runner = new_scheduler(max_num_seqs=2)
    add_parallel(scheduler, "p", 6, n=3, max_tokens=2)
    scheduler.add_request(make_request("q", 3, max_tokens=1))
    sched, outputs = runner.step()
    assert scheduled(sched) == {"p/0": 6, "p/1": 0}
    assert new_tokens(outputs) == {"p/0": [100], "p/1": [110]}
    assert [r.request_id for r in scheduler.waiting] == ["p/2", "q"]
    assert [r.request_id for r in scheduler.running] == ["p/0", "p/1"]
    sched, _ = runner.step()
    assert scheduled(sched) == {"p/0": 1, "p/1": 1}
    sched, outputs = runner.step()
    assert scheduled(sched) == {"p/2": 2, "q": 3}  # 4 of p/2's 6 tokens were a prefix hit
    assert new_tokens(outputs) == {"p/2": [120], "q": [100]}
    run_until_idle(runner)
    assert all_blocks_free(scheduler)


def test_prompt_logprobs_survive_preemption_and_prefix_hits(new_scheduler):
    scheduler, runner = new_scheduler(num_blocks=4, max_num_batched_tokens=5)
    scheduler.add_request(make_request("a", 8, max_tokens=3))
    prompt = [50, 51, 52, 53, 54, 55]
    scheduler.add_request(make_request("b", prompt, max_tokens=2, prompt_logprobs=1))
    assert scheduled(runner.step()[0]) == {"a": 5}
    assert scheduled(runner.step()[0]) == {"a": 3, "b": 2}  # b: logprobs of positions 1, 2
    # a's 9th token takes the last free block: b, the newest, cannot grow and is preempted
    # before its prompt is done, to be recomputed from its first token.
    sched, _ = runner.step()
    assert sched.preempted_ids == ["b"] and scheduled(sched) == {"a": 1}
    outputs = run_until_idle(runner)
    (first,) = [o for o in outputs if o.request_id == "b" and o.prompt_logprobs is not None]
    assert first.prompt_logprobs == [None, 1, 2, 3, 4, 5]  # once per position, not twice

    # Its prompt is now cached; a request that wants prompt logprobs must still get them all.
    scheduler.add_request(make_request("c", prompt, max_tokens=1, prompt_logprobs=1))
    (output,) = run_until_idle(runner)
    assert output.prompt_logprobs == [None, 1, 2, 3, 4, 5]
    assert all_blocks_free(scheduler)


def test_decode_role_reservation_reuses_the_cached_prefix(new_scheduler):
    # x's prompt lands and decodes; its full prompt blocks stay in the prefix cache. y shares
    # the first 8 tokens (2 blocks of 4): its reservation starts with x's blocks, and only the
    # rest is to be written by the prefill worker (delta transfer).
    scheduler, runner = new_scheduler(num_blocks=8, block_size=4, role=Role.DECODE)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    x_blocks = scheduler.reserve_remote(make_request("x", prefix + [13, 14], max_tokens=2))
    assert scheduler.requests["x"].num_cached_tokens == 0
    _land(scheduler, runner, "x", 42)
    runner.step()
    assert "x" not in scheduler.requests and all_blocks_free(scheduler)

    y_blocks = scheduler.reserve_remote(make_request("y", prefix + [20, 21, 22], max_tokens=2))
    assert y_blocks[:2] == x_blocks[:2] and len(y_blocks) == 3
    assert scheduler.requests["y"].num_cached_tokens == 8
    # A salted request (another tenant) never shares them, nor does a prompt that ends on the
    # boundary reuse its last block (the last token is always sent).
    z_blocks = scheduler.reserve_remote(make_request("z", prefix + [20], max_tokens=2, cache_salt="t"))
    assert not set(z_blocks) & set(y_blocks) and scheduler.requests["z"].num_cached_tokens == 0
    w_blocks = scheduler.reserve_remote(make_request("w", prefix, max_tokens=2))
    assert w_blocks[0] == x_blocks[0] and scheduler.requests["w"].num_cached_tokens == 4
    for request_id in ("y", "z", "w"):
        _land(scheduler, runner, request_id, 42)
    while scheduler.has_unfinished_requests():
        runner.step()
    assert all_blocks_free(scheduler)
    scheduler.kv_manager.check_integrity()
