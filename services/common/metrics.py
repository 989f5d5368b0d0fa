"""Prometheus plumbing every pdserve process shares: its registry, the latency buckets, the
``--metrics-port`` flag and the scrape endpoints.

    registry = new_registry()                       # one per process (a router, a worker, a kvstore)
    registry.register(MyCollector(...))             # gauges read at scrape time
    server = start_metrics_server(args.metrics_port, args.host, registry)   # workers, kvstore
    ...
    server.close()

The router serves the same text format on its own HTTP port (``GET /metrics``, see
``services/router/http/server.py``) with ``render(registry)``. prometheus_client's server
thread blocks in ``accept`` between scrapes: an idle process pays nothing for it.

Both serve the classic text format whatever the scraper's ``Accept`` header asks: Prometheus asks
for OpenMetrics first, and prometheus_client (0.26) writes OpenMetrics sample names with ``:``
turned into ``_`` (``vllm_num_requests_running``), so no vLLM dashboard would find the series.

Names and labels follow ``shared/METRICS.md``: vLLM names on workers, Dynamo frontend names on
the router, ``pdserve_*`` for the rest. Never register a deprecated vLLM name here.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from services.common.settings import add_env_argument

# Seconds; resolves CPU-scale latencies from 1 ms to 60 s (TTFT may go past 60 s: +Inf holds it).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
# TTFT may queue behind long prompts: same resolution, up to vLLM's 640 s.
TTFT_BUCKETS_S: tuple[float, ...] = (*LATENCY_BUCKETS_S, 120.0, 240.0, 480.0, 640.0)
# Token counts (prompt / generation lengths): powers of two up to 128 Ki tokens.
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(1 << i) for i in range(18))
CONTENT_TYPE = CONTENT_TYPE_LATEST


def new_registry() -> CollectorRegistry:
    """A registry with the process and platform collectors (``process_*``, ``python_info``).
    Each service object owns one, so two routers in one test process do not collide."""
    registry = CollectorRegistry()  # no auto_describe: collectors are read only when scraped
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text exposition format (``CONTENT_TYPE``)."""
    return generate_latest(registry)


def add_metrics_argument(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` (``PDSERVE_METRICS_PORT``): 0 picks a free port, -1 turns metrics off."""
    add_env_argument(parser, "--metrics-port", type=int, default=0,
                     help="Prometheus /metrics HTTP port (0: any free port, printed at start; "
                          "-1: no metrics)")


@dataclass
class MetricsServer:
    """prometheus_client's HTTP server on its own daemon thread; ``close`` stops it."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> MetricsServer | None:
    """Serve ``registry`` on ``http://host:port/metrics`` (port 0: any free port); None when
    ``port`` is -1 (metrics off). Raises OSError naming the port when it cannot bind."""
    if port < -1:
        raise ValueError(f"--metrics-port must be -1 (off), 0 (any) or a port number, got {port}")
    if port == -1:
        return None
    app = make_wsgi_app(registry)

    def text_format_only(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body: Iterable[bytes] = app({**environ, "HTTP_ACCEPT": "text/plain"}, start_response)  # module docstring
        return body

    try:
        server = make_server(host, port, text_format_only, ThreadingWSGIServer, handler_class=_QuietHandler)
    except OSError as error:
        raise OSError(f"cannot bind the metrics server to {host}:{port} ({error}); "
                      "is the port in use?") from error
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    return MetricsServer(host, server.server_address[1], server, thread)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        """No access log line per scrape."""
