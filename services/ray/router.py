"""The ingress deployment: each replica runs an unchanged ``pdserve serve router`` pointed at
the workers in the AddressBook and proxies Serve's HTTP requests to it, streaming (SSE) bodies
chunk by chunk.

The router takes its workers as fixed lists, so when membership changes (a worker scaled in or
out, replaced after a failed health check) the replica starts a second router with the new
lists, switches new requests to it once it is SERVING, and lets the old one drain
(SIGTERM: in-flight requests finish). Membership is long-polled, so nothing polls at rest.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from ray import serve
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from services.ray.args import PdserveServingArgs
from services.ray.process import ServiceProcess

log = logging.getLogger("ray.serve")
# Hop-by-hop headers a proxy must not forward (RFC 9110 section 7.6.1).
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate", "host", "content-length"}
WATCH_TIMEOUT_S = 30.0  # one long-poll of the AddressBook
READ_TIMEOUT_S = 600.0  # a streamed response may go this long between chunks


def worker_lists(members: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[str], list[str]]:
    """(prefill addresses, decode addresses), each sorted, from an AddressBook snapshot."""
    return (sorted(m["grpc"] for m in members.get("prefill", {}).values()),
            sorted(m["grpc"] for m in members.get("decode", {}).values()))


class RouterIngress:
    """Serve's HTTP ingress; ``__call__`` forwards any path (``/v1/completions``,
    ``/v1/chat/completions``, ``/health``, ...) to this replica's pdserve router."""

    async def __init__(self, args: PdserveServingArgs, address_book: Any,  # type: ignore[misc]  # Serve awaits it
                       *workers: Any) -> None:
        """``workers``: the worker deployments' handles, bound so Serve runs them with this
        application; requests never go through them (KV moves worker to worker)."""
        self.args = args
        self.address_book = address_book
        self.replica_id = f"router-{serve.get_replica_context().replica_tag}"
        self.log_dir = Path(args.log_dir or tempfile.gettempdir()) / "pdserve-ray"
        self.router: ServiceProcess | None = None
        self.serving_workers: tuple[list[str], list[str]] = ([], [])
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=10, sock_read=READ_TIMEOUT_S))
        self.generation = 0
        version, members = await self._wait_for_workers()
        await self._swap(worker_lists(members))
        self._watcher = asyncio.create_task(self._watch(version))

    async def _wait_for_workers(self) -> tuple[int, dict[str, dict[str, dict[str, Any]]]]:
        """The first snapshot with at least one prefill and one decode worker (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.args.startup_timeout_s
        version, members = await self.address_book.snapshot.remote()
        while not all(worker_lists(members)):
            if loop.time() > deadline:
                raise RuntimeError(f"no prefill and decode workers published within "
                                   f"{self.args.startup_timeout_s} s: {members}")
            version, members = await self.address_book.wait_change.remote(version, 5.0)
        return version, members

    async def _watch(self, version: int) -> None:
        while True:
            try:
                version, members = await self.address_book.wait_change.remote(
                    version, WATCH_TIMEOUT_S)
                lists = worker_lists(members)
                if lists != self.serving_workers and all(lists):
                    await self._swap(lists)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep the current router; retry after a pause
                log.exception("%s: membership update failed", self.replica_id)
                await asyncio.sleep(1.0)

    async def _swap(self, lists: tuple[list[str], list[str]]) -> None:
        """Start a router over ``lists``; once SERVING it takes new requests and the old drains."""
        prefill, decode = lists
        self.generation += 1
        argv = ["router", "--prefill", ",".join(prefill), "--decode", ",".join(decode),
                "--transfer", self.args.transfer, "--drain-grace-s", str(self.args.drain_grace_s),
                *(["--model", self.args.model] if self.args.model else []), *self.args.router.args]
        env = {"PDSERVE_REDIS_URL": self.args.redis_url} if self.args.redis_url else {}
        router = ServiceProcess(f"{self.replica_id}-{self.generation}", argv,
                                ("--http-port", "--grpc-port"), "127.0.0.1", "127.0.0.1",
                                self.log_dir, env, is_public=True)
        try:
            await router.wait_serving(self.args.startup_timeout_s)
        except Exception:
            await asyncio.to_thread(router.stop, 0.0)
            raise
        old, self.router, self.serving_workers = self.router, router, lists
        log.info("%s: router %s serves prefill=%s decode=%s", self.replica_id, router.address,
                 prefill, decode)
        if old is not None:
            asyncio.get_running_loop().run_in_executor(None, old.stop, self.args.drain_grace_s)

    async def __call__(self, request: Request) -> Response:
        router = self.router
        if router is None:
            return Response("no router yet", status_code=503)
        url = f"http://127.0.0.1:{router.ports['--http-port']}{request.url.path}"
        if request.url.query:
            url += "?" + request.url.query
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = await self.session.request(request.method, url, headers=headers,
                                              data=await request.body())
        reply_headers = {k: v for k, v in upstream.headers.items()
                         if k.lower() not in HOP_HEADERS}

        async def body() -> Any:
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
            finally:
                upstream.release()

        return StreamingResponse(body(), status_code=upstream.status, headers=reply_headers)

    async def workers(self) -> tuple[list[str], list[str]]:
        """(prefill, decode) addresses the serving router was started with."""
        return self.serving_workers

    async def check_health(self) -> None:
        if self.router is None or not await self.router.is_serving():
            raise RuntimeError(f"{self.replica_id}: its pdserve router is not SERVING")

    def __del__(self) -> None:
        """Stop watching and stop the router (it drains); idempotent."""
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and not watcher.done():
            watcher.cancel()
        router, self.router = getattr(self, "router", None), None
        if router is not None:
            router.stop(self.args.drain_grace_s)
