"""The generated protobuf / gRPC modules, generated on first import (see protogen.py).

Usage::

    from services.common.pb import generate_pb2, worker_pb2_grpc

Protobuf objects stay at the service edge: handlers convert them to engine dataclasses
once and never pass them into ``engine/``.
"""

from services.common.protogen import ensure_generated

ensure_generated()

from services.common.gen.pdserve.v1 import (  # noqa: E402
    generate_pb2,
    generate_pb2_grpc,
    kv_pb2,
    kv_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = ["generate_pb2", "generate_pb2_grpc", "kv_pb2", "kv_pb2_grpc", "kvstore_pb2", "kvstore_pb2_grpc",
           "worker_pb2", "worker_pb2_grpc"]
