"""A DecodeMany call takes its request's outputs straight from the engine's dispatch
(``OutputQueue.sink``, ``OutputStream._take``): the same responses in the same order as the
task's loop writes them, the finished one through the queue, and whatever the sink cannot take
(a full outbox, a cancelled call, an output it fails to convert) left to the loop in order.
The engine's dispatch runs here on the event loop as the engine thread schedules it; the
outputs are the engine's RequestOutput."""

from __future__ import annotations

import asyncio

import pytest

from engine.scheduler.output import RequestOutput
from services.common.async_engine import AsyncEngine
from services.decode import decode_many
from services.decode.decode_many import CallWriter, Outbox
from services.decode.output_stream import NowaitWriter, OutputStream


def _outputs(request_id: str, n: int) -> list[RequestOutput]:
    return [RequestOutput(request_id, [100 + i], finished=i == n - 1,
                          finish_reason="length" if i == n - 1 else None) for i in range(n)]


async def _stream_through(engine: AsyncEngine, writer, steps: list[list[RequestOutput]],
                          on_step=lambda i: None) -> tuple[list[tuple[str, list[int]]], OutputStream, int]:
    """Run one OutputStream per request id seen in ``steps`` into ``writer``, dispatching a step
    per loop turn; (what reached the outbox in order, the last stream, the on_output count)."""
    seen: list[str] = []
    for step in steps:
        for output in step:
            if output.request_id not in seen:
                seen.append(output.request_id)
    calls = 0

    def on_output(output, response) -> None:
        nonlocal calls
        calls += 1

    streams = {rid: OutputStream(engine, rid, engine.subscribe(rid)) for rid in seen}
    tasks = [asyncio.ensure_future(s.write_all(writer, on_output)) for s in streams.values()]
    await asyncio.sleep(0)  # each task installs its sink and waits
    for i, step in enumerate(steps):
        engine._dispatch(step)
        on_step(i)
        for _ in range(3):
            await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    outbox: Outbox = writer.outbox
    written = [(r.request_id, list(r.token_ids)) for r in outbox._outputs]
    return written, streams[seen[-1]], calls


async def _start(engine: AsyncEngine, writer: CallWriter, request_id: str
                 ) -> tuple[OutputStream, asyncio.Future[None]]:
    """A call's OutputStream writing into ``writer``, its sink installed."""
    stream = OutputStream(engine, request_id, engine.subscribe(request_id))
    task = asyncio.ensure_future(stream.write_all(writer, lambda o, r: None))
    await asyncio.sleep(0)
    return stream, task


def test_the_sink_writes_what_the_loop_would_and_the_task_wakes_only_to_finish():
    async def scenario():
        engine = AsyncEngine()
        writer = CallWriter(Outbox())
        assert isinstance(writer, NowaitWriter)
        a, b = _outputs("a", 5), _outputs("b", 3)
        steps = [[a[i]] + ([b[i]] if i < 3 else []) for i in range(5)]
        wakeups = 0
        real_next = engine.next_output

        async def counting(queue):
            nonlocal wakeups
            wakeups += 1
            return await real_next(queue)

        engine.next_output = counting  # type: ignore[method-assign]
        written, stream, calls = await _stream_through(engine, writer, steps)
        # per request, its tokens in order, each once, the finished one last
        for rid, n in (("a", 5), ("b", 3)):
            assert [t for r, t in written if r == rid] == [[100 + i] for i in range(n)]
        assert calls == 8 and stream.finished and stream.num_streamed == 3
        assert wakeups == 2  # one per request: its finished output, nothing per token
        assert all(q.sink is None for q in engine._queues.values())  # detached at the end

    asyncio.run(scenario())


def test_what_the_sink_refuses_goes_through_the_queue_in_order():
    """A full outbox (the pump stalled, then sending again): the outputs the sink refuses wait
    in the queue (where later ones join them), the task writes them, and every token reaches
    the stream once, in order."""
    async def scenario():
        engine = AsyncEngine()
        outbox = Outbox()
        writer = CallWriter(outbox)
        sent: list[int] = []
        stalled = True

        async def pump() -> None:  # Outbox.pump without gRPC: sends when not stalled
            while True:
                await asyncio.sleep(0)
                if not stalled and outbox._outputs:
                    sent.extend(t for r in outbox._outputs for t in r.token_ids)
                    outbox._outputs.clear()
                    outbox._sent.set()

        def on_step(i: int) -> None:
            nonlocal stalled
            stalled = i < 4

        pumping = asyncio.ensure_future(pump())
        try:
            await _stream_through(engine, writer, [[o] for o in _outputs("a", 8)], on_step)
        finally:
            pumping.cancel()
        sent.extend(t for r in outbox._outputs for t in r.token_ids)
        assert sent == [100 + i for i in range(8)]

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(decode_many, "MAX_QUEUED", 3)  # the sink refuses from 2 unsent on
        asyncio.run(scenario())


def test_a_cancelled_call_takes_nothing_more_from_the_dispatch():
    async def scenario():
        engine = AsyncEngine()
        writer = CallWriter(Outbox())
        _, task = await _start(engine, writer, "a")
        writer.task = task  # type: ignore[assignment]
        outs = _outputs("a", 4)
        engine._dispatch([outs[0]])
        assert len(writer.outbox._outputs) == 1  # taken by the sink, no wake-up
        writer.cancel()
        engine._dispatch([outs[1]])  # refused: queued for a task that is cancelled
        assert len(writer.outbox._outputs) == 1
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine._queues["a"].sink is None

    asyncio.run(scenario())


def test_a_conversion_the_sink_cannot_do_fails_in_the_calls_own_task():
    async def scenario():
        engine = AsyncEngine()
        writer = CallWriter(Outbox())
        _, task = await _start(engine, writer, "a")
        bad = RequestOutput("a", [1], finish_reason="no such reason")  # decode_response raises
        _, other_task = await _start(engine, writer, "b")
        engine._dispatch([bad, *_outputs("b", 1)])  # the dispatch goes on to "b"
        with pytest.raises(KeyError):
            await asyncio.wait_for(task, 5)
        await asyncio.wait_for(other_task, 5)
        assert [r.request_id for r in writer.outbox._outputs] == ["b"]

    asyncio.run(scenario())


def test_an_output_behind_a_queued_one_waits_its_turn():
    """Room again in the outbox while an output still waits in the queue for its task: the
    next output must queue behind it, not overtake it through the sink."""
    async def scenario():
        engine = AsyncEngine()
        outbox = Outbox()
        writer = CallWriter(outbox)
        _, task = await _start(engine, writer, "a")
        outs = _outputs("a", 5)
        engine._dispatch([outs[0]])
        engine._dispatch([outs[1]])
        engine._dispatch([outs[2]])  # the outbox holds 2: refused, queued, its task not run yet
        sent = [t for r in outbox._outputs for t in r.token_ids]
        outbox._outputs.clear()  # the pump sent them: room again
        engine._dispatch([outs[3]])
        engine._dispatch([outs[4]])
        await asyncio.wait_for(task, 5)
        sent += [t for r in outbox._outputs for t in r.token_ids]
        assert sent == [100, 101, 102, 103, 104]

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(decode_many, "MAX_QUEUED", 3)
        asyncio.run(scenario())
