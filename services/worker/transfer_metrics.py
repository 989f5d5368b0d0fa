"""KV transfer timings of a prefill worker, one observation per request whose KV went out.

    metrics.transfer.done("nixl", seconds, num_bytes)   # every block confirmed at the decode worker
    metrics.transfer.failed("grpc")                     # the push failed: the request failed

A transfer's time runs from its first chunk push to the last confirmation (it overlaps the
prefill: chunks go out while later ones compute). ``transport`` is the method the request used
(``nixl`` | ``grpc``). The vLLM NIXL names (``vllm:nixl_*``) carry the ``nixl`` transfers only,
as in vLLM; ``pdserve_kv_transfer_seconds{transport}`` and
``pdserve_kv_transfer_failures_total{transport}`` carry both. Bytes and blocks since start
(sent, saved by a delta transfer) are the collector's, from ``TransferCounters``.
``TransferMetrics.disabled()`` records nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.metrics import LATENCY_BUCKETS_S
from services.common.wire import TRANSFERS

TRANSPORTS = TRANSFERS
BYTES_BUCKETS: tuple[float, ...] = tuple(float(1024 * 4 ** i) for i in range(11))  # 1 KiB .. 1 GiB


@dataclass(frozen=True)
class TransferMetrics:
    """Bound to one worker's labels (``model_name``, ``engine``, ``role``, ``worker``)."""

    labels: tuple[str, ...]
    seconds: Histogram | None
    failures: Counter | None
    nixl_seconds: Histogram | None
    nixl_bytes: Histogram | None
    nixl_failures: Counter | None

    @classmethod
    def create(cls, registry: CollectorRegistry, label_names: tuple[str, ...],
               labels: tuple[str, ...]) -> TransferMetrics:
        with_transport = (*label_names, "transport")
        seconds = Histogram("pdserve_kv_transfer_seconds", "A request's KV push: first chunk to last "
                            "confirmation (s).", with_transport, registry=registry, buckets=LATENCY_BUCKETS_S)
        failures = Counter("pdserve_kv_transfer_failures", "Requests whose KV push failed.", with_transport,
                           registry=registry)
        nixl_seconds = Histogram("vllm:nixl_xfer_time_seconds", "A request's KV transfer over NIXL (s).",
                                 label_names, registry=registry, buckets=LATENCY_BUCKETS_S)
        nixl_bytes = Histogram("vllm:nixl_bytes_transferred", "Bytes of a request's KV transfer over NIXL.",
                               label_names, registry=registry, buckets=BYTES_BUCKETS)
        nixl_failures = Counter("vllm:nixl_num_failed_transfers", "KV transfers over NIXL that failed.",
                                label_names, registry=registry)
        for transport in TRANSPORTS:  # zero series: rate() and the dashboards work at once
            seconds.labels(*labels, transport)
            failures.labels(*labels, transport)
        nixl_seconds.labels(*labels)
        nixl_bytes.labels(*labels)
        nixl_failures.labels(*labels)
        return cls(labels, seconds, failures, nixl_seconds, nixl_bytes, nixl_failures)

    @classmethod
    def disabled(cls) -> TransferMetrics:
        return cls((), None, None, None, None, None)

    def done(self, transport: str, seconds: float, num_bytes: int) -> None:
        if self.seconds is None:
            return
        _check(transport)
        self.seconds.labels(*self.labels, transport).observe(max(seconds, 0.0))
        if transport == "nixl":
            assert self.nixl_seconds is not None and self.nixl_bytes is not None  # made with self.seconds
            self.nixl_seconds.labels(*self.labels).observe(max(seconds, 0.0))
            self.nixl_bytes.labels(*self.labels).observe(num_bytes)

    def failed(self, transport: str) -> None:
        if self.failures is None:
            return
        _check(transport)
        self.failures.labels(*self.labels, transport).inc()
        if transport == "nixl":
            assert self.nixl_failures is not None  # made with self.failures
            self.nixl_failures.labels(*self.labels).inc()


def _check(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"KV transport {transport!r} is not one of {TRANSPORTS}")
