"""Stream one OpenAI request and record what arrived when; check a target URL is loopback.

    record = await stream_request(session, "http://127.0.0.1:8000", "model", spec, timeout_s=120)

Works with any OpenAI-compatible server: ``/v1/completions`` for a prompt, ``/v1/chat/completions``
for messages, ``stream: true`` with ``stream_options.include_usage``. Token counts come from the
final usage chunk; a server that sends none leaves ``tokens_from`` empty for the caller to count.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import time
import urllib.parse
from typing import Any

import aiohttp

from loadtests.load.prompts import RequestSpec
from loadtests.load.record import (
    CONNECT,
    EMPTY,
    HTTP_4XX,
    HTTP_5XX,
    STREAM_ERROR,
    TIMEOUT,
    RequestRecord,
)


def check_loopback(base_url: str, allow_remote: bool = False) -> None:
    """Raise ValueError unless ``base_url`` is http(s) and resolves only to loopback addresses
    (or ``allow_remote``)."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base URL must look like http://127.0.0.1:8000, got {base_url!r}")
    if allow_remote:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, proto=socket.IPPROTO_TCP)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve {parts.hostname!r}: {error}") from None
    remote = sorted({info[4][0] for info in infos if not ipaddress.ip_address(info[4][0]).is_loopback})
    if remote:
        raise ValueError(f"{base_url} resolves to non-loopback {remote}; pass --allow-remote to load it")


async def fetch_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id of ``GET /v1/models``."""
    async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as response:
        response.raise_for_status()
        return str((await response.json())["data"][0]["id"])


async def stream_request(session: aiohttp.ClientSession, base_url: str, model: str, spec: RequestSpec,
                         timeout_s: float) -> RequestRecord:
    """Send ``spec`` and read its stream to the end; never raises for a failed request."""
    path = "/v1/chat/completions" if spec.messages is not None else "/v1/completions"
    record = RequestRecord(spec.index, spec.class_name, sent=time.perf_counter())
    pieces: list[str] = []
    try:
        async with session.post(f"{base_url}{path}", json=spec.body(model),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            record.status = response.status
            if response.status != 200:
                record.error_kind = HTTP_4XX if response.status < 500 else HTTP_5XX
                record.error = (await response.text())[:300]
                record.finished = time.perf_counter()
                return record
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                _read_event(json.loads(line[5:]), record, pieces)
                if record.error_kind:
                    break
    except TimeoutError as error:
        record.error_kind, record.error = TIMEOUT, f"no complete answer in {timeout_s} s ({error!r})"
    except aiohttp.ClientConnectionError as error:
        record.error_kind, record.error = CONNECT, f"{type(error).__name__}: {error}"[:300]
    except (aiohttp.ClientError, ValueError) as error:
        record.error_kind, record.error = STREAM_ERROR, f"{type(error).__name__}: {error}"[:300]
    record.finished = time.perf_counter()
    record.text = "".join(pieces)
    if not record.error_kind and not record.stamps:
        record.error_kind, record.error = EMPTY, "the stream carried no text"
    return record


def _read_event(event: dict[str, Any], record: RequestRecord, pieces: list[str]) -> None:
    if "error" in event:
        record.error_kind, record.error = STREAM_ERROR, str(event["error"])[:300]
        return
    for choice in event.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            record.stamps.append(time.perf_counter())
            pieces.append(text)
    usage = event.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.completion_tokens = int(usage.get("completion_tokens", 0))
        record.tokens_from = "usage"
