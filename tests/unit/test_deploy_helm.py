"""helm/pdserve: lint and template for the defaults and the variants operators use, every
manifest valid against the Kubernetes schemas, and what matters asserted (gRPC probes,
selectors that match their pods, PDBs that allow evictions, secrets referenced not inlined)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.unit.helm_render import CHART, CRD_KINDS, RELEASE, by_kind, containers, env_of, helm, lint, notes, render

K8S_VERSION = kubernetes_validate.latest_version()
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "external-redis": {"redis": {"enabled": False,
                                 "external": {"url": "redis://redis.infra.svc:6379/2"}}},
    "keda": {"autoscaling": {"mode": "keda"}, "serviceMonitor": {"enabled": True}},
    "hpa": {"autoscaling": {"mode": "hpa"}},
    "2p4d": {"prefill": {"replicas": 2}, "decode": {"replicas": 4}, "transfer": "nixl",
             "ucxNetDevices": "eth0"},
    "pvc-model-apikey": {"model": {"source": "pvc", "path": "smollm2.gguf",
                                   "pvc": {"claimName": "models"}},
                         "apiKey": {"value": "s3cret-key"}},
    "init-model-existing-key": {"model": {"source": "initContainer", "path": "m",
                                          "initContainer": {"command": ["sh", "-c", "true"]}},
                                "apiKey": {"existingSecret": "team-key"}},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_is_clean(variant: str) -> None:
    report = lint(VARIANTS[variant])
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_is_valid_kubernetes(variant: str) -> None:
    manifests = render(VARIANTS[variant])
    assert manifests
    for manifest in manifests:
        if manifest["kind"] in CRD_KINDS:
            assert manifest["apiVersion"] in ("keda.sh/v1alpha1", "monitoring.coreos.com/v1")
            continue
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_probes_are_native_grpc_and_selectors_match(variant: str) -> None:
    manifests = render(VARIANTS[variant])
    workloads = [m for m in manifests if m["kind"] in WORKLOAD_KINDS]
    assert {m["metadata"]["name"] for m in workloads} >= {
        f"{RELEASE}-pdserve-{role}" for role in ("router", "prefill", "decode", "kvstore")}
    for workload in workloads:
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items(), workload["metadata"]["name"]
        if workload["metadata"]["name"].endswith("-redis"):
            continue
        for container in containers(workload):
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                kind = "tcpSocket" if (probe, container["name"]) == ("livenessProbe", "router") \
                    else "grpc"  # the router's health follows its workers'; alive is enough
                assert container[probe][kind] == {"port": port}, (workload["metadata"], probe)
            assert container["args"][0] in ("router", "prefill", "decode", "kvstore")
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["terminationGracePeriodSeconds"] > 30  # longer than the drain
    for service in by_kind(manifests, "Service").values():
        targets = [w for w in workloads if service["spec"]["selector"].items()
                   <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, service["metadata"]["name"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pdbs_allow_evictions(variant: str) -> None:
    values = VARIANTS[variant]
    manifests = render(values)
    pdbs = by_kind(manifests, "PodDisruptionBudget")
    assert len(pdbs) == 3
    workloads = {m["metadata"]["name"]: m for m in manifests if m["kind"] in WORKLOAD_KINDS}
    for name, pdb in pdbs.items():
        workload = workloads[name]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= \
            workload["spec"]["template"]["metadata"]["labels"].items()
        if "minAvailable" in pdb["spec"]:
            replicas = workload["spec"].get("replicas", 1)
            if "replicas" in workload["spec"]:
                assert pdb["spec"]["minAvailable"] < replicas, name
        else:
            assert pdb["spec"]["maxUnavailable"] >= 1


def test_router_lists_every_worker_replica() -> None:
    manifests = render(VARIANTS["2p4d"])
    router = by_kind(manifests, "Deployment")[f"{RELEASE}-pdserve-router"]
    env = env_of(containers(router)[0])
    assert len(env["PDSERVE_PREFILL"].split(",")) == 2
    decode = env["PDSERVE_DECODE"].split(",")
    assert decode[3] == f"{RELEASE}-pdserve-decode-3.{RELEASE}-pdserve-decode.serving.svc:50071"
    sets = by_kind(manifests, "StatefulSet")
    assert sets[f"{RELEASE}-pdserve-decode"]["spec"]["replicas"] == 4
    assert env["PDSERVE_TRANSFER"] == "nixl"


def test_autoscaled_router_lists_up_to_max_replicas() -> None:
    manifests = render({"autoscaling": {"mode": "keda"}, "decode": {"autoscaling": {
        "minReplicas": 1, "maxReplicas": 6}}})
    env = env_of(containers(by_kind(manifests, "Deployment")[f"{RELEASE}-pdserve-router"])[0])
    assert len(env["PDSERVE_DECODE"].split(",")) == 6
    assert "replicas" not in by_kind(manifests, "StatefulSet")[f"{RELEASE}-pdserve-decode"]["spec"]


def test_keda_scales_workers_on_queue_and_kv_usage() -> None:
    manifests = render(VARIANTS["keda"])
    scaled = by_kind(manifests, "ScaledObject")
    assert set(scaled) == {f"{RELEASE}-pdserve-prefill", f"{RELEASE}-pdserve-decode"}
    prefill = scaled[f"{RELEASE}-pdserve-prefill"]["spec"]
    assert prefill["scaleTargetRef"]["kind"] == "StatefulSet"
    assert "vllm:num_requests_waiting" in prefill["triggers"][0]["metadata"]["query"]
    assert "vllm:kv_cache_usage_perc" in \
        scaled[f"{RELEASE}-pdserve-decode"]["spec"]["triggers"][0]["metadata"]["query"]
    assert set(by_kind(manifests, "HorizontalPodAutoscaler")) == {f"{RELEASE}-pdserve-router"}
    (monitor,) = by_kind(manifests, "PodMonitor").values()
    port_name = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    for workload in by_kind(manifests, "StatefulSet").values():
        if workload["spec"]["template"]["metadata"]["labels"].get("pdserve.io/metrics") == "true":
            assert port_name in {p["name"] for p in containers(workload)[0]["ports"]}
    (service_monitor,) = by_kind(manifests, "ServiceMonitor").values()
    router_service = by_kind(manifests, "Service")[f"{RELEASE}-pdserve-router"]
    assert service_monitor["spec"]["endpoints"][0]["port"] in \
        {p["name"] for p in router_service["spec"]["ports"]}


def test_monitoring_scrapes_every_metrics_pod_and_ships_the_recording_rules() -> None:
    """Workers and the kvstore carry the PodMonitor's label and port; the PrometheusRule is the
    rules file docker-compose mounts (one copy); the router gets goodput's targets."""
    import yaml

    manifests = render({"serviceMonitor": {"enabled": True}, "slo": {"ttftSeconds": 2.5, "tpotSeconds": 0.2}})
    (monitor,) = by_kind(manifests, "PodMonitor").values()
    port_name = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    scraped = set()
    for kind in ("StatefulSet", "DaemonSet"):
        for name, workload in by_kind(manifests, kind).items():
            if workload["spec"]["template"]["metadata"]["labels"].get("pdserve.io/metrics") == "true":
                assert port_name in {p["name"] for p in containers(workload)[0]["ports"]}, name
                scraped.add(name)
    assert scraped == {f"{RELEASE}-pdserve-{role}" for role in ("prefill", "decode", "kvstore")}
    (rule,) = by_kind(manifests, "PrometheusRule").values()
    assert rule["spec"] == yaml.safe_load((CHART / "prometheus" / "pdserve-rules.yml").read_text())
    env = env_of(containers(by_kind(manifests, "Deployment")[f"{RELEASE}-pdserve-router"])[0])
    assert (env["PDSERVE_SLO_TTFT_S"], env["PDSERVE_SLO_TPOT_S"]) == ("2.5", "0.2")
    assert not by_kind(render(), "PrometheusRule")  # only with serviceMonitor.enabled


def test_external_redis_renders_no_redis_and_passes_the_url() -> None:
    manifests = render(VARIANTS["external-redis"])
    assert not [m for m in manifests if m["metadata"]["name"].endswith("-redis")]
    for workload in (m for m in manifests if m["kind"] in WORKLOAD_KINDS):
        for container in containers(workload):
            assert env_of(container)["PDSERVE_REDIS_URL"] == "redis://redis.infra.svc:6379/2"
    assert "external Redis at redis://redis.infra.svc:6379/2" in notes(VARIANTS["external-redis"])


def test_bundled_redis_has_no_persistence() -> None:
    redis = by_kind(render(), "StatefulSet")[f"{RELEASE}-pdserve-redis"]
    args = containers(redis)[0]["args"]
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


def test_api_key_is_a_secret_reference_never_inlined() -> None:
    manifests = render(VARIANTS["pvc-model-apikey"])
    secret = by_kind(manifests, "Secret")[f"{RELEASE}-pdserve-api-key"]
    assert "s3cret-key" not in str(secret)  # base64 in data, not stringData
    for manifest in manifests:
        if manifest["kind"] != "Secret":
            assert "s3cret-key" not in str(manifest), manifest["metadata"]["name"]
    router = by_kind(manifests, "Deployment")[f"{RELEASE}-pdserve-router"]
    ref = env_of(containers(router)[0])["PDSERVE_API_KEY"]["secretKeyRef"]
    assert ref == {"name": f"{RELEASE}-pdserve-api-key", "key": "api-key"}
    existing = render(VARIANTS["init-model-existing-key"])
    assert set(by_kind(existing, "Secret")) == {f"{RELEASE}-pdserve-internal-token"}  # no API-key one
    router = by_kind(existing, "Deployment")[f"{RELEASE}-pdserve-router"]
    assert env_of(containers(router)[0])["PDSERVE_API_KEY"]["secretKeyRef"]["name"] == "team-key"


def test_every_pod_reads_the_internal_token_from_a_secret() -> None:
    """Created with a random value (never from values), or an existing Secret referenced."""
    for overrides, secret_name in (({}, f"{RELEASE}-pdserve-internal-token"),
                                   ({"internalToken": {"existingSecret": "cluster-token", "key": "t"}},
                                    "cluster-token")):
        manifests = render(overrides)
        secrets = by_kind(manifests, "Secret")
        if overrides:
            assert secret_name not in secrets
        else:
            token = secrets[secret_name]["data"]["internal-token"]
            assert len(token) >= 48 and "stringData" not in secrets[secret_name]
            assert token != by_kind(render(overrides), "Secret")[secret_name]["data"]["internal-token"]
        key = overrides.get("internalToken", {}).get("key", "internal-token")
        for kind in ("Deployment", "StatefulSet", "DaemonSet"):
            for name, workload in by_kind(manifests, kind).items():
                if name.endswith("-redis"):
                    continue
                ref = env_of(containers(workload)[0])["PDSERVE_INTERNAL_TOKEN"]["secretKeyRef"]
                assert ref == {"name": secret_name, "key": key}, name
    with pytest.raises(Exception, match="internalToken"):
        render({"internalToken": {"value": "inlined"}})  # the schema has no place for one


def test_model_sources_mount_models() -> None:
    pvc = by_kind(render(VARIANTS["pvc-model-apikey"]), "StatefulSet")[f"{RELEASE}-pdserve-decode"]
    pod = pvc["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"
    assert env_of(pod["containers"][0])["PDSERVE_MODEL"] == "/models/smollm2.gguf"
    init = by_kind(render(VARIANTS["init-model-existing-key"]), "Deployment")[f"{RELEASE}-pdserve-router"]
    assert init["spec"]["template"]["spec"]["initContainers"][0]["command"] == ["sh", "-c", "true"]


def test_dashboards_config_maps_carry_the_sidecar_label() -> None:
    config_maps = by_kind(render(), "ConfigMap")
    for config_map in config_maps.values():
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert all(key.endswith(".json") for key in config_map["data"])


def test_notes_tell_how_to_reach_the_router() -> None:
    text = notes()
    assert f"port-forward svc/{RELEASE}-pdserve-router 8000:8000" in text


@pytest.mark.parametrize("bad, named", [
    ({"decode": {"replicas": -1}}, "replicas"),
    ({"transfer": "carrier-pigeon"}, "transfer"),
    ({"autoscaling": {"mode": "sometimes"}}, "mode"),
    ({"redis": {"enabled": False, "external": {"url": ""}}}, "url"),
    ({"prefil": {"replicas": 1}}, "prefil"),
])
def test_bad_values_are_rejected_by_the_schema(bad: dict[str, Any], named: str) -> None:
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmValuesError, match=named):
        chart.validate_schema(chart.merge_values(bad))
    with pytest.raises(helm.HelmError):
        render(bad)


def test_router_pdb_that_blocks_every_eviction_fails_render() -> None:
    with pytest.raises(helm.HelmError, match="minAvailable"):
        render({"router": {"replicas": 1}})


def test_bad_values_file_names_every_offending_key() -> None:
    text = "transfer: udp\ndecode:\n  replicas: -2\n  port: 50071\n"
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmValuesError) as error:
        chart.validate_schema(chart.merge_values(helm.values_from_yaml(text)))
    assert "/transfer" in str(error.value) and "/decode/replicas" in str(error.value)


def test_every_value_is_used_by_a_template() -> None:
    """No value that the templates ignore (production-stack#886): each leaf key of
    values.yaml is read by some template (by its last name, after ``.`` in a template)."""
    import yaml

    templates = "\n".join(p.read_text() for p in (CHART / "templates").glob("*"))

    def leaves(node: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        if isinstance(node, dict) and node and path[-1:] not in (("resources",), ("labels",)):
            return [leaf for key, value in node.items() for leaf in leaves(value, (*path, key))]
        return [path]

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    unused = [".".join(p) for p in leaves(values) if f".{p[-1]}" not in templates]
    assert unused == []
