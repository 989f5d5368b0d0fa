"""A real Prometheus server for tests: Debian's ``prometheus`` package (the Makefile installs it
where it can), on loopback, in a temporary directory, scraping given targets every second and
evaluating the recording rules every second.

    with PrometheusServer.start(tmp_path, {"router": ["127.0.0.1:8000"]}, [RULES_FILE]) as prom:
        prom.wait_for_scrapes(3, timeout_s=60)
        prom.query("up")            # the API's result list (instant query)

``available()`` tells whether both binaries are on PATH (tests skip without them).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.integration.cluster_fixtures import free_port


def available() -> bool:
    return shutil.which("prometheus") is not None and shutil.which("promtool") is not None


class PrometheusServer:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    @classmethod
    def start(cls, workdir: Path, jobs: dict[str, list[str]], rule_files: list[Path],
              timeout_s: float = 30.0) -> PrometheusServer:
        """``jobs``: job name -> ``host:port`` targets serving ``/metrics``."""
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(p) for p in rule_files],
                  "scrape_configs": [{"job_name": job, "honor_labels": True,
                                      "static_configs": [{"targets": targets}]} for job, targets in jobs.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log_path = workdir / "prometheus.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                 "--storage.tsdb.retention.time=1h"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        try:
            server._wait_ready(timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"prometheus not ready after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise ValueError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """An instant query's result (a list of series; a scalar comes back as one entry)."""
        data = self.api("query", query=promql)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]

    def query_range(self, promql: str, start: float, end: float, step_s: float) -> list[dict]:
        return self.api("query_range", query=promql, start=str(start), end=str(end), step=str(step_s))["result"]

    def wait_for_scrapes(self, num_scrapes: int, timeout_s: float) -> None:
        """Until every target is up and has been scraped ``num_scrapes`` times."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ups = self.query("count_over_time(up[5m])")
            down = self.query("up == 0")
            if ups and not down and min(float(s["value"][1]) for s in ups) >= num_scrapes:
                return
            time.sleep(0.5)
        raise TimeoutError(f"targets not scraped {num_scrapes} times in {timeout_s} s: "
                           f"{self.query('up')}\n{self.log_tail()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> PrometheusServer:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
