"""EngineCore on its own thread, driven from asyncio.

The engine loop runs ``step()`` back to back while there is work, and between steps applies
the commands that async handlers queued (add, abort, reserve, ...). Each request's outputs go
to an asyncio queue owned by the handler that added it. Every service (colocated router,
prefill, decode) wraps its engine in one of these; nothing else touches the EngineCore.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache.events import KVCacheEvent
from engine.models.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler.output import RequestOutput
from engine.stats import EngineStats, Sendable
from services.common.engine_log import StepLog
from services.common.native_thread_name import set_native_thread_name

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.005  # how long the loop sleeps when nothing is schedulable
ENGINE_THREAD_NAME = "engine-loop"  # also the OS's name for it (top -H, /proc/<pid>/task/*/comm)


class OutputQueue(asyncio.Queue[RequestOutput | BaseException]):
    """One request's outputs, or why it died. A get returns the first output queued together
    with those of the same sample right behind it, as one (``RequestOutput.absorb``): a
    consumer that fell behind the engine (a decode worker's gRPC writes, the router's SSE
    writes, more per step than the step takes) catches up in one write instead of one per
    step, so the cost per token falls as the load rises. Nothing waits for more: a consumer
    that keeps up gets every step's output on its own.

    ``sink``, when its consumer sets one: the engine's dispatch offers it each output that is
    not the finished one while nothing is queued, and queues what it refuses (returns False):
    a consumer that can take an output at once (a DecodeMany call's outbox) then costs no task
    wake-up per token; the finished output always comes through the queue."""

    sink: Callable[[RequestOutput], bool] | None = None

    def _init(self, maxsize: int) -> None:
        self._queue: deque[RequestOutput | BaseException] = deque()

    def _get(self) -> RequestOutput | BaseException:
        queue = self._queue
        item = queue.popleft()
        if isinstance(item, BaseException):
            return item
        while queue:
            later = queue[0]
            if isinstance(later, BaseException) or not item.can_absorb(later):
                break
            queue.popleft()
            item = item.absorb(later)
        return item


class EngineDead(RuntimeError):
    """The engine thread stopped; no request can be served."""


class AsyncEngine:
    """Create with a built core and ``start()``, or with none and ``await build(make_core)``
    (what services do: see ``build``)."""

    def __init__(self, core: EngineCore | None = None) -> None:
        self._core = core
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._queues: dict[str, OutputQueue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._kv_event_sink: Callable[[list[KVCacheEvent]], None] | None = None
        self.error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()

    async def build(self, make_core: Callable[[], EngineCore]) -> EngineCore:
        """Run ``make_core()`` (load the model, build the core) on a new engine thread, then
        the engine loop on that same thread; returns the core, or raises what ``make_core``
        raised (the thread then ends).

        One thread for both because libgomp keeps an OpenMP thread team for every thread that
        ever opened a parallel region, and once it manages more threads than there are cores
        it stops spinning between regions: a model built on another thread that stays alive
        (the event loop's, an executor's) made every decode step of a 2-thread engine on 2
        cores 31.5 ms instead of 21 ms (``pdserve up --colocated``: ITL 1.43x the offline
        engine's per-token time)."""
        self._loop = loop = asyncio.get_running_loop()
        built: asyncio.Future[EngineCore] = loop.create_future()

        def build_then_run() -> None:
            try:
                self._core = make_core()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, built, e)
                return
            loop.call_soon_threadsafe(_set_result, built, self._core)
            self._run()

        self._thread = threading.Thread(target=build_then_run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()
        return await built

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- API for async handlers ------------------------------------------------------
    # Reads that do not pause the engine (EngineCore documents why they are safe from another
    # thread); everything that changes the engine goes through call().

    @property
    def core(self) -> EngineCore:
        """The core given to the constructor or built by ``build``; nothing below runs before."""
        assert self._core is not None, "AsyncEngine used before it has a core (see build)"
        return self._core

    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop ``start`` or ``build`` ran on: handlers' results are handed back on it."""
        assert self._loop is not None, "AsyncEngine used before start() or build()"
        return self._loop

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.core.kv_cache

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    def stats(self) -> EngineStats:
        return self.core.stats()

    def spec_stats(self) -> dict[str, object] | None:
        """``EngineCore.spec_stats``: speculation counters, None when speculation is off."""
        return self.core.spec_stats()

    def prefetch_prefix(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Start the kvstore's lookup of a prompt that is about to be added or reserved
        (``EngineCore.prefetch_prefix``: any thread, never blocks)."""
        self.core.prefetch_prefix(prompt_token_ids, params)

    def sendable(self, request_id: str) -> Sendable | None:
        return self.core.sendable(request_id)

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run ``fn(core)`` on the engine thread between two steps; return its result or
        raise its exception."""
        if not self.is_alive:
            raise EngineDead(f"engine thread is not running: {self.error!r}")
        future: asyncio.Future[T] = self._event_loop.create_future()

        def command() -> None:
            try:
                result = fn(self.core)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._event_loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                self._event_loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.append(command)
        self._wake.set()
        return await future

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile ``params``' structured-output constraint (if any) on a worker thread, within
        the compiler's time limit, so that the engine loop never waits for a compile: the
        add_request or reserve_remote that follows finds it cached. Raises
        StructuredOutputError (a ValueError) naming the request field at fault."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.core.constraints.compile, params.structured_outputs)

    def set_kv_event_sink(self, sink: Callable[[list[KVCacheEvent]], None] | None) -> None:
        """After every engine-loop iteration (commands, then a step), drain the core's KV events
        (``EngineCore.take_kv_events``; the engine must be built with ``enable_kv_events``) and
        hand a non-empty list to ``sink`` on the engine thread. ``sink`` must be quick and must
        not block (e.g. ``IndexPublisher.publish``); its exceptions are logged, never fatal."""
        self._kv_event_sink = sink

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs until every sample finished. Closing the
        iterator early (client gone, stop string) aborts the request in the engine."""
        self.prefetch_prefix(prompt_token_ids, params)
        await self.compile_constraint(params)
        queue = self.subscribe(request_id)
        finished = 0
        try:
            await self.call(lambda core: core.add_request(request_id, prompt_token_ids, params))
            while finished < params.n:
                output = await self.next_output(queue)
                finished += output.finished
                yield output
        finally:
            self.unsubscribe(request_id)
            if finished < params.n and self.is_alive:
                await self.call(lambda core: core.abort_request(request_id))

    def subscribe(self, request_id: str) -> OutputQueue:
        """Route outputs of ``request_id`` (and of its samples) to a new queue."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue = OutputQueue()
        self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @staticmethod
    async def next_output(queue: OutputQueue) -> RequestOutput:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    # ---- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        set_native_thread_name(ENGINE_THREAD_NAME)
        step_log = StepLog(time.monotonic())
        self.core.step_timer.enabled = True  # the device's time per step, for step_log's line
        try:
            while not self._stopping:
                while self._commands:
                    self._commands.popleft()()
                outputs = self.core.step() if self.core.has_unfinished_requests() else []
                if self._kv_event_sink is not None:
                    self._drain_kv_events(self._kv_event_sink)
                if outputs:
                    self._event_loop.call_soon_threadsafe(self._dispatch, outputs)
                    step_log.num_tokens_out += sum(len(o.new_token_ids) for o in outputs)
                line = step_log.observe(time.monotonic(), self.core)
                if line is not None:
                    log.info("%s", line)
                if not outputs and not self._commands:
                    self._wake.wait(IDLE_WAIT_S if self.core.has_unfinished_requests() else 0.5)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - a dead engine must fail every waiter
            log.exception("engine loop died")
            self.error = e
            self._event_loop.call_soon_threadsafe(self._fail_all, e)

    def _drain_kv_events(self, sink: Callable[[list[KVCacheEvent]], None]) -> None:
        events = self.core.take_kv_events()
        if events:
            try:
                sink(events)
            except Exception:  # noqa: BLE001 - the index is advisory; serving goes on
                log.exception("KV event sink failed; %d events dropped", len(events))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.parent_id or output.request_id)
            if queue is None:
                continue
            sink = queue.sink
            if sink is not None and not output.finished and queue.empty() and sink(output):
                continue
            queue.put_nowait(output)

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDead(f"engine loop died: {error!r}"))


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
