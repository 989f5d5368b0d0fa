"""A request's output queue (services/common/async_engine.py OutputQueue): a consumer that fell
behind the engine gets what queued up for a sample as one output (``RequestOutput.absorb``), in
order, nothing lost; one that keeps up gets each step's output alone.

The last cases run a real AsyncEngine on a tiny random model (tests/unit/test_async_scheduling.py)
and read its queue only after the request has finished, against the engine's outputs read one
step at a time."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from engine.request import Request
from engine.sampling.logprobs import PositionLogprobs
from engine.scheduler.output import RequestOutput
from services.common.async_engine import AsyncEngine, EngineDead, OutputQueue
from tests.unit.test_async_scheduling import make_core, prompt, tiny_model


def lp(token_id: int) -> PositionLogprobs:
    return PositionLogprobs(token_id, -0.5, 1, [(token_id, -0.5)])


def out(request_id: str, tokens: list[int], *, finish: str | None = None, logprobs: bool = False,
        prompt_logprobs: list[PositionLogprobs | None] | None = None, computed: int = 0,
        index: int = 0, parent: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, tokens, finished=finish is not None, finish_reason=finish,
                         stop_reason=2 if finish == "stop" else None,
                         new_logprobs=[lp(t) for t in tokens] if logprobs else None,
                         prompt_logprobs=prompt_logprobs, num_prompt_tokens=5, num_cached_tokens=computed // 2,
                         num_computed_tokens=computed, parent_id=parent, index=index)


def drain(queue: OutputQueue) -> list[RequestOutput | BaseException]:
    got = []
    while not queue.empty():
        got.append(queue.get_nowait())
    return got


def test_absorb_joins_the_tokens_and_logprobs_and_keeps_the_later_state():
    first = out("r", [5], logprobs=True, prompt_logprobs=[None, lp(3)], computed=6)
    later = out("r", [6, 7], logprobs=True, finish="stop", computed=8)
    assert first.can_absorb(later)
    joined = first.absorb(later)
    assert joined.new_token_ids == [5, 6, 7]
    assert [p.token_id for p in joined.new_logprobs] == [5, 6, 7]
    assert joined.prompt_logprobs == [None, lp(3)]  # only the first output carries them
    assert (joined.finished, joined.finish_reason, joined.stop_reason) == (True, "stop", 2)
    assert (joined.num_computed_tokens, joined.num_cached_tokens, joined.num_prompt_tokens) == (8, 4, 5)
    assert first.new_token_ids == [5] and later.new_token_ids == [6, 7]  # neither changed
    assert first.absorb(out("r", [6])).new_logprobs == [lp(5)]


def test_a_steps_output_carries_the_requests_state():
    request = Request("r/1", [1, 2, 3], SamplingParams(), parent_id="r", index=1)
    request.num_cached_tokens, request.num_computed_tokens = 2, 3
    assert RequestOutput.of(request, [7]) == RequestOutput(
        "r/1", [7], num_prompt_tokens=3, num_cached_tokens=2, num_computed_tokens=3, parent_id="r", index=1)


def test_what_is_never_absorbed():
    running = out("r", [5])
    assert not running.can_absorb(out("other", [6]))  # another sample
    assert not out("r", [5], finish="length").can_absorb(out("r", [6]))  # after the end
    assert not running.can_absorb(out("r", [], finish="abort"))  # a failure stays its own
    assert not running.can_absorb(out("r", [], finish="error"))


def test_a_lagging_get_takes_the_queued_run_of_one_sample():
    queue = OutputQueue()
    for i in range(4):
        queue.put_nowait(out("r", [10 + i], finish="length" if i == 3 else None))
    [got] = drain(queue)
    assert isinstance(got, RequestOutput)
    assert got.new_token_ids == [10, 11, 12, 13] and got.finish_reason == "length"


def test_a_get_that_keeps_up_is_one_step():
    async def scenario():
        queue = OutputQueue()
        got = []
        for i in range(3):
            queue.put_nowait(out("r", [i]))
            got.append(await queue.get())
        return got

    assert [o.new_token_ids for o in asyncio.run(scenario())] == [[0], [1], [2]]


def test_samples_interleaved_keep_each_samples_order():
    queue = OutputQueue()
    steps = [("p/0", [1]), ("p/1", [2]), ("p/0", [3]), ("p/0", [4]), ("p/1", [5])]
    for sample, tokens in steps:
        queue.put_nowait(out(sample, tokens, parent="p", index=int(sample[-1])))
    got = [(o.request_id, o.new_token_ids) for o in drain(queue)]
    assert got == [("p/0", [1]), ("p/1", [2]), ("p/0", [3, 4]), ("p/1", [5])]


def test_a_failure_and_an_exception_arrive_after_the_tokens_before_them():
    queue = OutputQueue()
    queue.put_nowait(out("r", [1]))
    queue.put_nowait(out("r", [2]))
    queue.put_nowait(out("r", [], finish="error"))
    dead = EngineDead("gone")
    queue.put_nowait(dead)
    got = drain(queue)
    assert [(o.new_token_ids, o.finish_reason) for o in got[:2]] == [([1, 2], None), ([], "error")]
    assert got[2] is dead


async def read_all(engine: AsyncEngine, queue: OutputQueue, num_samples: int) -> list[RequestOutput]:
    outputs, finished = [], 0
    while finished < num_samples:
        output = await asyncio.wait_for(engine.next_output(queue), 30.0)
        outputs.append(output)
        finished += output.finished
    return outputs


def run_engine(params: SamplingParams, lag: bool) -> list[RequestOutput]:
    """One request through a real AsyncEngine; with ``lag``, its queue is read only once the
    engine has finished it."""
    async def scenario() -> list[RequestOutput]:
        engine = AsyncEngine(make_core(tiny_model(), "cpu", "off"))
        engine.start()
        try:
            queue = engine.subscribe("q")
            await engine.call(lambda core: core.add_request("q", prompt(1, 9), params))
            if not lag:
                return await read_all(engine, queue, params.n)
            for _ in range(3000):
                if not await engine.call(lambda core: core.has_unfinished_requests()):
                    break
                await asyncio.sleep(0.005)
            return await read_all(engine, queue, params.n)
        finally:
            await asyncio.to_thread(engine.stop)

    return asyncio.run(scenario())


@pytest.fixture(autouse=True)
def torch_attention(monkeypatch):
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "torch")  # the tiny model's head_dim


def tokens_by_sample(outputs: list[RequestOutput]) -> dict[str, list[int]]:
    by_sample: dict[str, list[int]] = {}
    for output in outputs:
        by_sample.setdefault(output.request_id, []).extend(output.new_token_ids)
    return by_sample


def test_a_reader_behind_the_real_engine_gets_every_token_in_fewer_outputs():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    stepwise, lagging = run_engine(params, lag=False), run_engine(params, lag=True)
    expected = tokens_by_sample(stepwise)["q"]  # (how many outputs: as fast as this reader was)
    assert len(expected) == 12
    [caught_up] = lagging  # all 12 steps' outputs were queued: one get took them
    assert caught_up.new_token_ids == expected
    assert [p.token_id for p in caught_up.new_logprobs] == expected
    assert (caught_up.finish_reason, caught_up.finished) == ("length", True)


def test_parallel_samples_behind_the_real_engine_keep_their_tokens():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
    stepwise, lagging = run_engine(params, lag=False), run_engine(params, lag=True)
    assert tokens_by_sample(lagging) == tokens_by_sample(stepwise)
    assert sum(o.finished for o in lagging) == 2
