"""docker-compose.yml against the Compose specification's JSON schema, and the contract the
other deploy files rely on: health-gated start order, pdserve services as one `pdserve serve`
command each, one copy of the dashboards, a non-root image with that entrypoint.

The schema is the one the ``docker-compose`` package (1.29.2, Apache-2.0) ships as
``compose/config/compose_spec.json``; the Makefile downloads that wheel, without installing
it, into ``<venv>/deploy-tools/`` and the test reads the file straight from the wheel."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

from tests.integration.compose_services import REPO, load_compose, loopback_services

SCHEMA_MEMBER = "compose/config/compose_spec.json"
PDSERVE_SERVICES = {"kvstore", "prefill", "decode", "decode-2", "router"}


def compose_schema() -> dict:
    wheels = sorted((Path(sys.prefix) / "deploy-tools").glob("docker_compose-*.whl"))
    if not wheels:
        pytest.skip(f"no docker_compose wheel in {Path(sys.prefix) / 'deploy-tools'}: "
                    "run `make deploy-tools` (it downloads the Compose schema's package)")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        return json.loads(wheel.read(SCHEMA_MEMBER))


def test_compose_file_matches_the_compose_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = compose_schema()
    compose = load_compose()
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []
    for profile_env in ({}, {"PDSERVE_DECODE_ADDRS": "decode:50071,decode-2:50071"}):
        assert list(validator.iter_errors(load_compose(profile_env))) == []


def test_schema_rejects_a_broken_compose_file() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    compose = load_compose()
    compose["services"]["router"]["depends_on"]["decode"] = {"condition": "when_ready"}
    errors = list(jsonschema.Draft201909Validator(compose_schema()).iter_errors(compose))
    assert errors


def test_services_and_health_gated_order() -> None:
    services = load_compose()["services"]
    assert set(services) == PDSERVE_SERVICES | {"redis", "redis-chaos", "prometheus", "grafana"}
    for name, spec in services.items():
        assert "healthcheck" in spec, name
        for dependency in spec.get("depends_on", {}):
            assert dependency in services, (name, dependency)
    for name in ("prefill", "decode", "decode-2"):
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"},
                                                "kvstore": {"condition": "service_healthy"}}
    assert services["router"]["depends_on"] == {"prefill": {"condition": "service_healthy"},
                                                "decode": {"condition": "service_healthy"}}
    assert services["decode-2"]["profiles"] == ["two-decode"]
    assert services["redis-chaos"]["profiles"] == ["chaos"]
    assert all("profiles" not in spec for name, spec in services.items()
               if name not in ("decode-2", "redis-chaos"))


def test_pdserve_services_are_one_serve_command_with_a_pdserve_health_check() -> None:
    services = loopback_services(load_compose())
    assert set(services) == PDSERVE_SERVICES
    for service in services.values():
        assert service.compose_argv[0] in ("router", "prefill", "decode", "kvstore")
        assert service.health_argv and service.health_argv[0].startswith(("127.0.0.1:", "http://"))


def test_second_decode_joins_the_router_through_the_profile_variable() -> None:
    router = load_compose({"PDSERVE_DECODE_ADDRS": "decode:50071,decode-2:50071"})["services"]["router"]
    assert router["environment"]["PDSERVE_DECODE"] == "decode:50071,decode-2:50071"
    assert load_compose()["services"]["router"]["environment"]["PDSERVE_DECODE"] == "decode:50071"


def test_grafana_mounts_the_charts_dashboards() -> None:
    volumes = load_compose()["services"]["grafana"]["volumes"]
    sources = [v.split(":")[0] for v in volumes]
    assert "./helm/pdserve/dashboards" in sources
    for source in sources:
        assert (REPO / source).exists(), source


def test_prometheus_scrapes_every_metrics_port_and_loads_the_charts_rules() -> None:
    """Every pdserve service with a metrics port is a scrape target (the router on its HTTP port),
    and Prometheus mounts the one rules file the Helm chart ships too."""
    import yaml

    compose = load_compose()
    prometheus = compose["services"]["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"])
    assert "./deploy/compose/prometheus.yml" in mounts
    config = yaml.safe_load((REPO / "deploy" / "compose" / "prometheus.yml").read_text())
    assert mounts["./helm/pdserve/prometheus/pdserve-rules.yml"] in config["rule_files"]
    targets = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    for name, spec in compose["services"].items():
        env = spec.get("environment", {})
        if name in PDSERVE_SERVICES and "PDSERVE_METRICS_PORT" in env:
            assert f"{name}:{env['PDSERVE_METRICS_PORT']}" in targets, name
    expected = {"kvstore", "prefill", "decode", "decode-2"}
    assert {n for n in PDSERVE_SERVICES if "PDSERVE_METRICS_PORT" in compose["services"][n]["environment"]} == expected
    assert f"router:{compose['services']['router']['environment']['PDSERVE_HTTP_PORT']}" in targets


def test_dockerfile_is_non_root_with_the_serve_entrypoint() -> None:
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and all(not u.startswith(("root", "0")) for u in users)
    assert 'ENTRYPOINT ["pdserve", "serve"]' in lines
    assert "ARG VARIANT=cpu" in lines and "FROM base-${VARIANT} AS image" in lines


def test_secrets_come_from_the_hosts_environment() -> None:
    """The internal token reaches every pdserve service and the API key the router, each
    interpolated from the host's variable: nothing secret is written in the file."""
    raw = (REPO / "docker-compose.yml").read_text()
    assert 'PDSERVE_INTERNAL_TOKEN: "${PDSERVE_INTERNAL_TOKEN:-}"' in raw
    assert 'PDSERVE_API_KEY: "${PDSERVE_API_KEY:-}"' in raw
    unset = load_compose()["services"]  # quoted: an unset variable is "", not YAML's null
    assert unset["router"]["environment"]["PDSERVE_API_KEY"] == ""
    assert unset["prefill"]["environment"]["PDSERVE_INTERNAL_TOKEN"] == ""
    compose = load_compose({"PDSERVE_INTERNAL_TOKEN": "tok", "PDSERVE_API_KEY": "sk-1"})
    pdserve = {n: s for n, s in compose["services"].items() if "pdserve" in str(s.get("image", ""))}
    assert {n: s["environment"]["PDSERVE_INTERNAL_TOKEN"] for n, s in pdserve.items()} == dict.fromkeys(pdserve, "tok")
    assert [n for n, s in pdserve.items() if "PDSERVE_API_KEY" in s["environment"]] == ["router"]
    assert compose["services"]["router"]["environment"]["PDSERVE_API_KEY"] == "sk-1"
