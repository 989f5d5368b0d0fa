"""Debug mode's TTFT breakdown: the header value, its parser, what ``pdserve generate --timings``
prints, and the HTTP header a ``--debug-route`` router adds (and only then)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.backends.backend import TokenEvent
from services.router.client import timings_text
from services.router.http.server import build_app
from services.router.model_info import ModelInfo
from services.router.pipeline.debug_route import (
    ROUTE_HEADER,
    TTFT_HEADER,
    describe,
    format_breakdown,
    parse_breakdown,
)
from services.router.pipeline.frontend import Frontend, RouterState
from tests.unit.test_router_frontend import ALPHABET, CharTokenizer, ScriptedBackend


def test_breakdown_round_trips_in_stage_order():
    stages = {"ttft": 0.25, "prefill_compute": 0.2, "router_queue": 0.001, "decode_admit": 0.004}
    value = format_breakdown(stages)
    assert value == "router_queue=0.001000,prefill_compute=0.200000,decode_admit=0.004000,ttft=0.250000"
    assert parse_breakdown(value) == stages
    with pytest.raises(ValueError, match="prefil"):
        format_breakdown({"prefil": 0.1})
    for bad in ("ttft", "ttft=-1", "=0.1", "ttft=fast", "ttft=nan"):
        with pytest.raises(ValueError, match="name=seconds"):
            parse_breakdown(bad)


def test_timings_text_names_the_remainder_and_the_missing_flag():
    text = describe({"router_queue": 0.5, "prefill_compute": 0.2, "kv_transfer": 0.01, "ttft": 0.25},
                    "remote/load")
    assert "route remote/load" in text and "200.000 ms" in text
    assert "40.000 ms network and router" in text  # router_queue lies before the TTFT
    assert "--debug-route" in timings_text({})
    assert "prefill_compute" in timings_text({TTFT_HEADER: "prefill_compute=0.1,ttft=0.2"})


def _post(debug_route: bool) -> dict[str, str]:
    events = [TokenEvent(0, [1], route="remote/load",
                         ttft_stages={"prefill_queue": 0.001, "prefill_compute": 0.01}),
              TokenEvent(0, [2], finish_reason="length")]
    state = RouterState(ScriptedBackend(events), debug_route=debug_route)
    state.frontend = Frontend(CharTokenizer(), state.backend, ModelInfo("m", len(ALPHABET) + 1, 64),
                              state.metrics)

    async def scenario():
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            response = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
            assert response.status == 200, await response.text()
            return dict(response.headers)

    return asyncio.run(scenario())


def test_http_header_only_in_debug_mode():
    headers = _post(debug_route=True)
    assert headers[ROUTE_HEADER] == "remote/load"
    stages = parse_breakdown(headers[TTFT_HEADER])
    assert list(stages) == ["router_queue", "prefill_queue", "prefill_compute", "ttft"]
    assert stages["prefill_compute"] == 0.01 and stages["ttft"] > 0
    headers = _post(debug_route=False)
    assert ROUTE_HEADER not in headers and TTFT_HEADER not in headers
