"""docker-compose.yml's pdserve services as loopback processes: the same ``pdserve serve``
arguments and environment, with every bind address turned to 127.0.0.1 and every compose port
to a free one (``service:port`` in values and ``127.0.0.1:port`` in healthchecks rewritten)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.common.ports import free_port

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
PORT_VARS = ("PDSERVE_PORT", "PDSERVE_HTTP_PORT", "PDSERVE_GRPC_PORT", "PDSERVE_METRICS_PORT")
# Compose interpolation: ``$$`` is a literal ``$``; ``${VAR}`` / ``${VAR:-default}`` a variable.
_INTERPOLATION = re.compile(r"\$\$|\$\{(?P<name>[A-Z0-9_]+)(:-(?P<default>[^}]*))?\}")


@dataclass(frozen=True)
class ComposeService:
    """One service as a process: ``argv`` after ``pdserve serve``, its environment, and its
    healthcheck's ``pdserve health`` arguments, all already moved to loopback ports."""

    name: str
    argv: list[str]
    env: dict[str, str]
    health_argv: list[str]
    compose_argv: list[str]  # the command exactly as compose gives it


def load_compose(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml with ``${VAR:-default}`` interpolated from ``environ`` (default: none
    set, so every default applies) and YAML anchors merged."""
    environ = environ or {}
    text = _INTERPOLATION.sub(
        lambda m: "$" if m[0] == "$$" else environ.get(m["name"], m["default"] or ""),
        COMPOSE_FILE.read_text())
    return yaml.safe_load(text)


def loopback_services(compose: dict[str, Any]) -> dict[str, ComposeService]:
    """Every service whose image is pdserve's, moved to loopback and free ports."""
    services = {name: spec for name, spec in compose["services"].items()
                if "pdserve" in str(spec.get("image", ""))}
    moved: dict[str, str] = {}  # "service:port" -> "127.0.0.1:free"
    local_ports: dict[str, dict[str, str]] = {}  # service -> {"port": "free"}
    for name, spec in services.items():
        for var in PORT_VARS:
            port = str(spec.get("environment", {}).get(var, ""))
            if port:
                free = str(free_port())
                moved[f"{name}:{port}"] = f"127.0.0.1:{free}"
                local_ports.setdefault(name, {})[port] = free
    plans: dict[str, ComposeService] = {}
    for name, spec in services.items():
        env = {key: _rewrite(str(value), moved) for key, value in spec["environment"].items()}
        env["PDSERVE_HOST"] = "127.0.0.1"
        for var in PORT_VARS:
            if var in env:
                env[var] = local_ports[name][env[var]]
        health = list(spec["healthcheck"]["test"])
        if health[:3] != ["CMD", "pdserve", "health"]:
            raise ValueError(f"{name}: healthcheck must be `pdserve health ...`, got {health}")
        health_argv = [_local_health(arg, local_ports.get(name, {})) for arg in health[3:]]
        command = [str(word) for word in spec["command"]]
        plans[name] = ComposeService(name, list(command), env, health_argv, command)
    return plans


def _rewrite(value: str, moved: dict[str, str]) -> str:
    for before, after in moved.items():
        value = value.replace(before, after)
    return value


def _local_health(arg: str, ports: dict[str, str]) -> str:
    return re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports.get(m[1], m[1])}", arg)


def process_env(service: ComposeService) -> dict[str, str]:
    """The test process's environment plus the service's (which wins)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "UCX_NET_DEVICES": "lo", **service.env}
