"""``pdserve up`` wires its kvstore: every worker gets ``--kvstore-address`` (parsed back by the
worker's own parser, with its ``PDSERVE_KVSTORE_ADDRESS`` twin), and the kvstore gets the index's
``--redis-url``."""

from __future__ import annotations

from engine.config import Role
from services.kvstore.__main__ import build_parser as kvstore_parser


def test_up_passes_its_kvstore_to_every_worker_and_the_index_to_the_kvstore(tmp_path, monkeypatch):
    from services import launcher
    from services.worker.settings import worker_parser

    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://127.0.0.1:7/0")
    args = launcher.build_parser().parse_args(["--transfer", "grpc"])
    kvstore = launcher.plan_kvstore(args, tmp_path)
    assert kvstore is not None
    workers, _ = launcher.plan(args, tmp_path, kvstore.grpc_address)
    monkeypatch.delenv("PDSERVE_REDIS_URL")
    assert workers
    for worker in workers:
        serve = worker.argv.index("serve")
        parsed = worker_parser(Role(worker.argv[serve + 1]), 0).parse_args(worker.argv[serve + 2:])
        assert parsed.kvstore_address == kvstore.grpc_address
    flags = kvstore.argv[kvstore.argv.index("kvstore") + 1:]
    assert kvstore_parser().parse_args(flags).redis_url == "redis://127.0.0.1:7/0"


def test_the_worker_flag_reads_its_environment_twin(monkeypatch):
    from services.worker.settings import worker_parser

    monkeypatch.setenv("PDSERVE_KVSTORE_ADDRESS", "10.0.0.5:50081")
    assert worker_parser(Role.DECODE, 0).parse_args([]).kvstore_address == "10.0.0.5:50081"
    monkeypatch.delenv("PDSERVE_KVSTORE_ADDRESS")
    assert worker_parser(Role.DECODE, 0).parse_args([]).kvstore_address == ""


def test_without_a_kvstore_nothing_is_passed(tmp_path, monkeypatch):
    from services import launcher

    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    args = launcher.build_parser().parse_args(["--kvstore-gib", "0"])
    assert launcher.plan_kvstore(args, tmp_path) is None
    workers, _ = launcher.plan(args, tmp_path)
    assert all("--kvstore-address" not in w.argv for w in workers)


def test_kvstore_transfer_auto_follows_the_worker_transfer():
    from services.worker.server import kvstore_tier_from
    from services.worker.settings import worker_parser

    def transfer(*argv: str) -> str:
        args = worker_parser(Role.DECODE, 0).parse_args(["--kvstore-address", "127.0.0.1:1", *argv])
        tier = kvstore_tier_from(args)
        assert tier is not None
        tier.close()  # never started: nothing to stop
        return tier.config.transfer

    assert transfer() == "auto" and transfer("--transfer", "grpc") == "grpc"
    assert transfer("--transfer", "grpc", "--kvstore-transfer", "nixl") == "nixl"
    assert transfer("--kvstore-transfer", "grpc") == "grpc"
