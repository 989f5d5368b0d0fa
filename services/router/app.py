"""Wiring of the router: backend + tokenizer + the HTTP and gRPC servers, and the drain.

Start order: bind both servers first (health says NOT_SERVING / 503, so a port clash fails
fast), then start the backend (loading the model in colocated mode), then serve and log one
``router ready http=HOST:PORT grpc=HOST:PORT`` line. On SIGTERM / SIGINT: health turns
unhealthy, both servers stop taking requests and let in-flight ones finish for up to
``drain_grace_s``, then the backend closes. A second signal cancels what is left at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
from dataclasses import dataclass, field, replace

from engine.args import EngineArgs
from engine.heap import freeze_long_lived, thaw
from services.common.auth import KeySet
from services.common.grpc_server import AddServicer, GrpcServer, start_grpc_server
from services.common.pb import worker_pb2_grpc
from services.common.wire import GENERATE_SERVICE_NAME, WORKER_SERVICE_NAME
from services.router.backends.backend import Backend
from services.router.backends.colocated import ColocatedBackend
from services.router.grpc.servicer import GenerateServicer, add_generate_servicer
from services.router.http.auth import HttpAuth
from services.router.http.server import HttpServer, start_http_server
from services.router.metrics import SLO_TPOT_S, SLO_TTFT_S
from services.router.pipeline.admission import Admission, AdmissionConfig
from services.router.pipeline.frontend import Frontend, RouterState
from services.router.pipeline.limits import RequestLimits
from services.worker.stats import WorkerStatsServicer

log = logging.getLogger("pdserve.router")
HEALTH_POLL_S = 1.0  # how often the backend's health is mirrored into grpc.health.v1


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    model: str | None = None  # None: the embedded default model
    max_model_len: int | None = None
    drain_grace_s: float = 10.0
    debug_route: bool = False  # answer each request's route and TTFT breakdown in headers / trailers
    api_keys: KeySet = KeySet()  # empty: HTTP and gRPC open (services/router/http/auth.py)
    metrics_auth: bool = False  # GET /metrics needs a key too
    slo_ttft_s: float = SLO_TTFT_S  # goodput's targets (RouterMetrics.set_slo)
    slo_tpot_s: float = SLO_TPOT_S
    limits: RequestLimits = field(default_factory=RequestLimits)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)


class Router:
    """The running router; ``start`` then ``serve_until_signal`` (or ``stop``)."""

    def __init__(self, config: RouterConfig, backend: Backend) -> None:
        self.config = config
        self.state = RouterState(backend, limits=config.limits, admission=Admission(config.admission))
        self.state.metrics.set_slo(config.slo_ttft_s, config.slo_tpot_s)
        backend.attach_metrics(self.state.metrics)
        self.state.debug_route = config.debug_route
        self.http: HttpServer | None = None
        self.grpc: GrpcServer | None = None
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        config, backend = self.config, self.state.backend
        servicers: list[AddServicer] = [(add_generate_servicer, GenerateServicer(self.state))]
        names = [GENERATE_SERVICE_NAME]
        if isinstance(backend, ColocatedBackend):
            servicers.append((worker_pb2_grpc.add_WorkerServiceServicer_to_server,
                              WorkerStatsServicer(backend.stats, "router", "colocated",
                                                  backend.engine_args)))
            names.append(WORKER_SERVICE_NAME)
        self.grpc = await start_grpc_server(servicers, port=config.grpc_port, host=config.host,
                                            service_names=names, is_serving=False,
                                            public_api_keys=config.api_keys)
        self.http = await start_http_server(self.state, config.host, config.http_port,
                                            config.drain_grace_s,
                                            HttpAuth(config.api_keys, config.metrics_auth))
        if not config.api_keys.is_enabled and not is_loopback(config.host):
            log.warning("no API key configured and the router binds %s: anyone who can reach "
                        "it can use it (set PDSERVE_API_KEY or --api-key-file)", config.host)
        await backend.start()
        frontend = await asyncio.to_thread(self._build_frontend)
        # before the frontend serves: its engine's heap too, when colocated (engine/heap.py)
        freeze_long_lived("router")
        self.state.metrics.set_model(frontend.model.name)
        self.state.frontend = frontend
        await self.grpc.health.set_serving(await self.state.is_healthy())
        self._health_task = asyncio.create_task(self._mirror_health(self.grpc))
        log.info("router ready http=%s grpc=%s model=%s", self.http.address, self.grpc.address,
                 self.state.frontend.model.name)

    def _build_frontend(self) -> Frontend:
        backend = self.state.backend
        if isinstance(backend, ColocatedBackend):  # the engine already loaded both
            assert backend.tokenizer is not None and backend.model_info is not None  # by backend.start()
            return Frontend(backend.tokenizer, backend, backend.model_info, self.state.metrics,
                            self.state.limits, self.state.admission)
        from engine.models.loader import load_tokenizer
        from services.router.model_info import read_model_info

        return Frontend(load_tokenizer(self.config.model), backend,
                        read_model_info(self.config.model, self.config.max_model_len), self.state.metrics,
                        self.state.limits, self.state.admission)

    async def _mirror_health(self, grpc_server: GrpcServer) -> None:
        while not self.state.is_draining:
            is_healthy = await self.state.is_healthy()
            if is_healthy != grpc_server.health.is_serving:
                log.warning("backend health changed: %s", "serving" if is_healthy else "not serving")
                await grpc_server.health.set_serving(is_healthy)
            await asyncio.sleep(HEALTH_POLL_S)

    async def stop(self) -> None:
        """Drain both servers (in-flight requests finish within the grace period), then close
        the backend."""
        self.state.is_draining = True
        if self._health_task is not None:
            self._health_task.cancel()
        stops = []
        if self.grpc is not None:
            stops.append(self.grpc.stop(self.config.drain_grace_s))
        if self.http is not None:
            stops.append(self.http.stop())
        await asyncio.gather(*stops, return_exceptions=True)
        await self.state.backend.close()
        thaw()

    async def serve_until_signal(self) -> None:
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        main_task = asyncio.current_task()
        assert main_task is not None  # a coroutine runs in a task

        def on_signal() -> None:
            if stop_requested.is_set():  # second signal: stop waiting for the drain
                main_task.cancel()
            stop_requested.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await stop_requested.wait()
        log.info("router draining (grace %.0fs)", self.config.drain_grace_s)
        with contextlib.suppress(asyncio.CancelledError):
            await self.stop()
        log.info("router stopped")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; a name or a wildcard is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_backend(colocated: bool, model: str | None, engine_args: EngineArgs,
                  prefill: list[str], decode: list[str], transfer: str, redis_url: str = "",
                  local_prefill_max_tokens: int = 64, max_migrations: int = 3,
                  kv_full_wait_s: float = 60.0, index_budget_s: float | None = None) -> Backend:
    """The in-process engine built from ``engine_args`` (colocated), or the workers; with a
    ``redis_url`` the workers are picked by the prefix index (KV-aware, conditional
    disaggregation; a lookup gets ``index_budget_s``, default the client's 5 ms), else by
    load. A sample whose worker dies moves to another up to ``max_migrations`` times
    (services/router/backends/migration.py); one that finds every decode worker out of KV
    blocks waits up to ``kv_full_wait_s`` for some to free up."""
    if colocated:
        return ColocatedBackend(model, engine_args)
    from services.router.backends.disaggregated import DisaggregatedBackend  # lazily: workers only

    policy = None
    if redis_url:
        from services.router.routing.prefix_aware import ROUTER_CLIENT_CONFIG, PrefixAwarePolicy
        from services.router.routing.route_plan import RouteConfig

        client_config = ROUTER_CLIENT_CONFIG
        if index_budget_s is not None:
            client_config = replace(client_config, budget_s=index_budget_s)
        policy = PrefixAwarePolicy(redis_url, RouteConfig(local_prefill_max_tokens=local_prefill_max_tokens),
                                   client_config)
    return DisaggregatedBackend(prefill, decode, transfer=transfer, policy=policy,
                                max_migrations=max_migrations, kv_full_wait_s=kv_full_wait_s)


async def run_router(config: RouterConfig, backend: Backend) -> None:
    router = Router(config, backend)
    try:
        await router.start()
    except BaseException:
        await router.stop()
        raise
    await router.serve_until_signal()
