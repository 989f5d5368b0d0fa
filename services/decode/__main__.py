"""``pdserve serve decode``: a decode worker (DecodeService, KVTransferService, WorkerService).

    pdserve serve decode --port 50071 [--transfer nixl|grpc] [--model PATH] [--num-kv-blocks N]
                         [--reservation-lease-ms 60000] ...   (every flag: PDSERVE_* too)
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import Role
from services.worker.server import run_worker
from services.worker.settings import worker_parser

DEFAULT_PORT = 50071


def main(argv: Sequence[str] | None = None) -> None:
    from services.decode.handler import DecodeWorker

    run_worker(argv, worker_parser(Role.DECODE, DEFAULT_PORT), Role.DECODE, DecodeWorker)


if __name__ == "__main__":
    main()
