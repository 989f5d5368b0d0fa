"""DisaggregatedBackend: each sample runs on workers over gRPC, on one of three paths; the
router's pipeline uses it through the Backend interface.

One request::

    generate(request_id, prompt, params)
      └─ n samples (sample i: params.for_sample(i), converted to protobuf once: sample.py)
           plan = policy.plan(...)          the load policy: None (pick as it goes); prefix-aware:
                                            both workers and the path (routing/route_plan.py)
           Migration.run(first attempt)     a lost worker: start over, or resume (migration.py)
             LocalPath.run                  plan says local: one decode worker does both
             RemotePath.run                 else: prefill worker, then decode worker

* n > 1 runs n independent samples (sample i seeded seed + i, as offline) and merges their
  events; the prompt is prefilled once per sample (the prefill prefix cache softens it).
* A full or unreachable worker before the first event: the next one is tried, and a sample
  that finds every decode worker out of KV blocks waits for some (prefill_start.py).
* Closing the iterator (stop string, client gone) closes every sample's path, which cancels
  its calls: each worker frees what it holds.
* A worker lost mid-stream is marked unhealthy until a health check passes again, and the
  sample migrates, at most ``max_migrations`` times. Other failures end the request with
  BackendError (worker_errors.py). Every call carries a deadline: the request's time left
  (services/router/deadline.py) when it has one, else the call's default.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence

from engine.sampling_params import SamplingParams
from services.common.wire import TRANSFER_METHODS, compat_from_proto
from services.router.backends.backend import Backend, TokenEvent
from services.router.backends.local_path import LocalPath
from services.router.backends.migration import DEFAULT_MAX_MIGRATIONS, Migration
from services.router.backends.placement import Placement
from services.router.backends.prefill_start import PrefillSettings
from services.router.backends.remote_path import RemotePath
from services.router.backends.sample import Sample
from services.router.metrics import RouterMetrics
from services.router.routing.policy import LoadPolicy, RoutingPolicy
from services.router.routing.route_plan import RoutePlan
from services.router.routing.worker_load import WorkerLoad
from services.router.routing.worker_pool import WorkerPool

log = logging.getLogger(__name__)


class DisaggregatedBackend(Backend):
    def __init__(self, prefill_addresses: Sequence[str], decode_addresses: Sequence[str],
                 transfer: str = "nixl", *, policy: RoutingPolicy | None = None,
                 poll_interval_s: float = 0.5, rpc_timeout_s: float = 1.0,
                 prefill_timeout_s: float = 300.0, decode_timeout_s: float = 3600.0,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS, kv_full_wait_s: float = 60.0) -> None:
        if not prefill_addresses or not decode_addresses:
            raise ValueError("a disaggregated router needs at least one prefill and one decode "
                             f"worker; got prefill={list(prefill_addresses)} "
                             f"decode={list(decode_addresses)}")
        if kv_full_wait_s < 0:
            raise ValueError(f"kv_full_wait_s must be >= 0, got {kv_full_wait_s}")
        if transfer not in TRANSFER_METHODS:
            raise ValueError(f"transfer must be one of {sorted(TRANSFER_METHODS)}, got {transfer!r}")
        self.pool = WorkerPool(prefill_addresses, decode_addresses, poll_interval_s, rpc_timeout_s)
        self.policy = policy or LoadPolicy()
        self.route_decisions = self.policy.decisions  # per path/reason (routing/route_decisions.py)
        self.placement = Placement(self.pool, self.policy)
        prefill = PrefillSettings(TRANSFER_METHODS[transfer], prefill_timeout_s, kv_full_wait_s)
        self.remote = RemotePath(self.placement, prefill, decode_timeout_s)
        self.local = LocalPath(self.remote, self.route_decisions, decode_timeout_s)
        self.migration = Migration(self.remote, self.placement, max_migrations, decode_timeout_s)

    @property
    def num_kv_full_waits(self) -> int:
        """Retries after every decode worker lacked free KV blocks, since start."""
        return self.remote.num_kv_full_waits

    @property
    def num_migrations(self) -> int:
        """Samples moved to another worker since start (migration.py)."""
        return self.migration.num_migrations

    def attach_metrics(self, metrics: RouterMetrics) -> None:
        """Routing decisions and the prefix index's health go to the router's metrics (TTFT
        stages travel on each sample's first TokenEvent: the pipeline observes them)."""
        self.route_decisions.listener = metrics.routing.decision
        self.policy.routing = metrics.routing

    async def start(self) -> None:
        await self.pool.start()
        await self._configure_policy()

    async def close(self) -> None:
        await self.remote.close()
        await self.pool.close()
        self.policy.close()

    async def is_healthy(self) -> bool:
        return bool(self.pool.healthy("prefill")) and bool(self.pool.healthy("decode"))

    async def _configure_policy(self) -> None:
        """Give the policy the workers' KV compatibility (once any worker answered GetStats).
        Workers that disagree, or an index with other hash settings, raise."""
        if self.policy.is_configured:
            return
        compats = {compat_from_proto(w.stats.kv_compat)
                   for ws in self.pool.workers.values() for w in ws
                   if w.stats.HasField("kv_compat") and w.stats.kv_compat.block_size}
        if len(compats) > 1:
            raise ValueError(f"workers report different KV caches, so no one prefix index fits "
                             f"them all: {sorted(map(str, compats))}")
        if compats:
            await asyncio.to_thread(self.policy.configure, compats.pop())

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> AsyncGenerator[TokenEvent, None]:
        """One sample's events are its ``_run`` itself (no pass-through generator per token);
        bad input raises at the first ``anext``, as from any backend."""
        prompt = list(prompt_token_ids)
        try:
            if not prompt:
                raise ValueError("prompt is empty: give at least one token")
            if params.n == 1:
                return self._run(Sample.create(request_id, prompt, params, 0))
            samples = [Sample.create(f"{request_id}/{i}", prompt, params.for_sample(i), i)
                       for i in range(params.n)]
        except ValueError as error:
            return _raising(error)
        return _merged([self._run(s) for s in samples])

    async def _run(self, sample: Sample) -> AsyncGenerator[TokenEvent, None]:
        """One sample: plan, then its path under migration."""
        planned_at = time.monotonic()
        plan = await self._plan(sample)
        stage = self.policy.plan_stage
        plan_s = time.monotonic() - planned_at
        events = self.migration.run(sample, self._first_attempt(sample, plan))
        try:
            async for event in events:
                if stage is not None and event.ttft_stages is not None:
                    event.ttft_stages[stage] = plan_s  # a sample's first event
                yield event
        finally:
            await events.aclose()
            self.policy.finish(sample.request_id)

    async def _plan(self, sample: Sample) -> RoutePlan | None:
        """The policy's plan of ``sample``; None (pick by load) when it has none or fails."""
        if not self.policy.is_configured:
            try:
                await self._configure_policy()
            except Exception as exc:  # noqa: BLE001 - logged; the index stays off, load routing
                log.error("prefix index not usable: %s", exc)
        try:
            return await self.policy.plan(sample.request_id, sample.prompt, sample.params, self._loads)
        except Exception:  # noqa: BLE001 - routing advice must never fail a request
            log.exception("routing plan of %s failed; routing by load", sample.request_id)
            self.route_decisions.record("remote/plan_error")
            return None

    def _loads(self) -> tuple[list[WorkerLoad], list[WorkerLoad]]:
        """The healthy (prefill, decode) workers' loads now (what this router began included)."""
        return ([w.load() for w in self.pool.healthy("prefill")],
                [w.load() for w in self.pool.healthy("decode")])

    def _first_attempt(self, sample: Sample, plan: RoutePlan | None) -> AsyncGenerator[TokenEvent, None]:
        """The sample on the path its plan chose: local when planned and possible, else remote."""
        if plan is not None and plan.path == "local" and not sample.wants_prompt_logprobs:
            decode = self.placement.healthy("decode", plan.decode_address)
            if decode is not None:
                return self.local.run(sample, decode, plan)
        return self.remote.run(sample, plan)


async def _raising(error: Exception) -> AsyncGenerator[TokenEvent, None]:
    """An event stream that fails with ``error`` when first read."""
    raise error
    yield  # unreachable: makes this an async generator


async def _merged(samples: list[AsyncGenerator[TokenEvent, None]]) -> AsyncGenerator[TokenEvent, None]:
    """The events of every sample as they come; the first error ends all of them."""
    queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()

    async def pump(sample: AsyncGenerator[TokenEvent, None]) -> None:
        try:
            async for event in sample:
                await queue.put(event)
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)
        finally:
            await sample.aclose()

    tasks = [asyncio.ensure_future(pump(s)) for s in samples]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
