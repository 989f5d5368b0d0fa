"""The ``pdserve`` command line: each subcommand's flags live in the module that runs it.

    pdserve up [--prefill N] [--decode M] [--colocated] [--transfer nixl|grpc] ...
    pdserve serve router|prefill|decode|kvstore [...]
    pdserve serve ray --config app.yaml  (the Ray Serve application: services/ray/)
    pdserve generate "prompt" [--stream] [--max-tokens N] [--temperature T] [--seed S]
                     [--json-schema S | --json-object | --regex R | --choice C ... | --grammar G]
    pdserve health HOST:PORT | http://HOST:PORT/health  (exit 0 when SERVING / 200)
    pdserve bench engine|kernels|serve|spec|kv|disagg|routing|prefix|offload|soak [...]  (loadtests/bench_*.py)
    pdserve bench load|compare [...]  (loadtests/load/: scenarios, goodput at SLO, plots)

Every flag can also come from a ``PDSERVE_*`` environment variable (see services.common.settings).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    ("up",): "services.launcher",
    ("serve", "router"): "services.router.__main__",
    ("serve", "prefill"): "services.prefill.__main__",
    ("serve", "decode"): "services.decode.__main__",
    ("serve", "kvstore"): "services.kvstore.__main__",
    ("serve", "ray"): "services.ray.__main__",
    ("generate",): "services.router.client",
    ("health",): "services.common.health_probe",
    ("bench", "engine"): "loadtests.bench_engine",
    ("bench", "kernels"): "loadtests.bench_kernels",
    ("bench", "serve"): "loadtests.bench_serve",
    ("bench", "spec"): "loadtests.bench_spec",
    ("bench", "kv"): "loadtests.bench_kv_transfer",
    ("bench", "disagg"): "loadtests.bench_disagg",
    ("bench", "load"): "loadtests.load.bench_load",
    ("bench", "compare"): "loadtests.load.bench_compare",
    ("bench", "routing"): "loadtests.bench_routing",
    ("bench", "offload"): "loadtests.bench_offload",
    ("bench", "prefix"): "loadtests.bench_prefix",
    ("bench", "soak"): "loadtests.soak",
}

USAGE = "usage: pdserve {" + " | ".join(" ".join(k) for k in COMMANDS) + "} [options]"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for words, module in COMMANDS.items():
        if tuple(argv[:len(words)]) == words:
            importlib.import_module(module).main(argv[len(words):])
            return
    print(USAGE, file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
