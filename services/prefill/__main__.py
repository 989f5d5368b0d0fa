"""``pdserve serve prefill``: a prefill worker (PrefillService, WorkerService).

    pdserve serve prefill --port 50061 [--transfer nixl|grpc] [--model PATH] [--num-kv-blocks N]
                          [--max-num-batched-tokens 512] ...   (every flag: PDSERVE_* too)
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import Role
from services.worker.server import run_worker
from services.worker.settings import worker_parser

DEFAULT_PORT = 50061


def main(argv: Sequence[str] | None = None) -> None:
    from services.prefill.handler import PrefillWorker

    run_worker(argv, worker_parser(Role.PREFILL, DEFAULT_PORT), Role.PREFILL, PrefillWorker)


if __name__ == "__main__":
    main()
