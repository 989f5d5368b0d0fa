"""Render helm/pdserve through the embedded Helm SDK (``helm-python-sdk``: Helm's Go library
over ctypes, installed from PyPI with the test extras) and split the output into manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
RELEASE, NAMESPACE = "rel", "serving"
# Custom resources whose schemas kubernetes-validate does not ship (their CRDs are not core).
CRD_KINDS = {"ScaledObject", "ServiceMonitor", "PodMonitor", "PrometheusRule"}

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk is not installed (`make test` installs it with .[dev])")


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every non-empty manifest of ``helm template`` with ``values`` over the defaults."""
    rendered = helm.Chart.load(CHART).render(values, name=RELEASE, namespace=NAMESPACE)
    manifests: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        manifests += [doc for doc in yaml.safe_load_all(text) if doc]
    return manifests


def notes(values: dict[str, Any] | None = None) -> str:
    rendered = helm.Chart.load(CHART).render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return helm.lint(CHART, values, strict=True)


def by_kind(manifests: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return list(manifest["spec"]["template"]["spec"]["containers"])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
