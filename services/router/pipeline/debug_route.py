"""Debug mode (``--debug-route``): the router tells each client how its request was routed
(``pdserve-route: path/reason``) and where its TTFT went (``pdserve-ttft-breakdown``), as HTTP
response headers / gRPC trailing metadata (``debug_headers``).

The value lists seconds per stage the request passed, in ``STAGES`` order (the dashboards'), then
``ttft`` (the router sent the request until its first token came back: every stage but
``router_queue`` lies inside it; what they leave over is the network and the router)::

    router_queue=0.000412,index_lookup=0.002100,prefill_queue=0.000300,prefill_compute=0.181000,
    kv_transfer=0.000900,decode_admit=0.004000,ttft=0.195000

``format_breakdown`` writes it; ``parse_breakdown`` reads it back (ValueError naming a bad item);
``describe`` is what ``pdserve generate --timings`` prints. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.router.metrics import STAGES

if TYPE_CHECKING:
    from services.router.pipeline.generation import Generation

ROUTE_HEADER = "pdserve-route"  # path/reason (services/router/routing/route_decisions.py keys)
TTFT_HEADER = "pdserve-ttft-breakdown"
_ORDER = {name: i for i, name in enumerate((*STAGES, "ttft"))}


def format_breakdown(stages: dict[str, float]) -> str:
    """``stages``: {stage or "ttft": seconds}; ValueError for a name outside STAGES and ttft."""
    unknown = set(stages) - _ORDER.keys()
    if unknown:
        raise ValueError(f"TTFT breakdown: {sorted(unknown)} are not stages {STAGES} or 'ttft'")
    return ",".join(f"{name}={stages[name]:.6f}" for name in sorted(stages, key=_ORDER.__getitem__))


def parse_breakdown(value: str) -> dict[str, float]:
    """The ``{name: seconds}`` of a header value; names outside STAGES and ttft are kept (a newer
    router may add stages) but each item must be ``name=seconds`` with seconds >= 0."""
    out: dict[str, float] = {}
    for item in filter(None, value.split(",")):
        name, sep, seconds = item.partition("=")
        try:
            parsed = float(seconds)
        except ValueError:
            parsed = -1.0
        if not sep or not name or not parsed >= 0.0:
            raise ValueError(f"TTFT breakdown item {item!r} is not name=seconds (seconds >= 0)")
        out[name.strip()] = parsed
    return out


def describe(stages: dict[str, float], route: str | None = None) -> str:
    """A few lines for a terminal: each stage in milliseconds, then the TTFT and its remainder."""
    width = max(map(len, stages), default=4)
    lines = [f"TTFT breakdown{f' (route {route})' if route else ''}:"]
    for name in sorted((n for n in stages if n != "ttft"), key=lambda n: _ORDER.get(n, len(_ORDER))):
        lines.append(f"  {name:<{width}} {stages[name] * 1e3:9.3f} ms")
    if "ttft" in stages:
        inside = sum(s for n, s in stages.items() if n not in ("ttft", "router_queue"))
        lines.append(f"  {'ttft':<{width}} {stages['ttft'] * 1e3:9.3f} ms "
                     f"({max(stages['ttft'] - inside, 0.0) * 1e3:.3f} ms network and router)")
    return "\n".join(lines)


def debug_headers(generation: Generation) -> tuple[tuple[str, str], ...]:
    """Debug mode's answer for a started request: its route (``path/reason``) and its TTFT
    breakdown, as HTTP headers / gRPC trailing metadata."""
    headers = ((ROUTE_HEADER, generation.route),) if generation.route else ()
    return (*headers, (TTFT_HEADER, format_breakdown(generation.ttft_stages)))
