"""The router's errors through the one gRPC mapper (services/router/grpc/status.py ->
services/common/grpc_errors.py): each row of the table, code and trailing metadata."""

from __future__ import annotations

import grpc
import pytest

from services.common.grpc_errors import status_of, trailing_metadata_of
from services.router import errors as e
from services.router.grpc.status import service_error

CODE = grpc.StatusCode


@pytest.mark.parametrize("error, code, metadata", [
    (e.ModelNotFound("gpt-9", "smollm2"), CODE.NOT_FOUND, ()),
    (e.InvalidRequest("max_tokens must be >= 1", "max_tokens"), CODE.INVALID_ARGUMENT,
     (("pdserve-invalid-param", "max_tokens"),)),
    (e.RefusedByBackend("guided_regex: does not compile", "guided_regex"), CODE.INVALID_ARGUMENT,
     (("pdserve-invalid-param", "guided_regex"),)),
    (ValueError("a backend's verdict"), CODE.INVALID_ARGUMENT, ()),
    (e.Overloaded("full", retry_after_s=2.2), CODE.RESOURCE_EXHAUSTED, (("retry-after", "3"),)),
    (e.Overloaded("full", retry_after_s=0.1), CODE.RESOURCE_EXHAUSTED, (("retry-after", "1"),)),
    (e.Unavailable("no healthy decode worker"), CODE.UNAVAILABLE, ()),
    (e.NotServing("draining"), CODE.UNAVAILABLE, ()),
    (e.RequestTimeout("deadline passed"), CODE.DEADLINE_EXCEEDED, ()),
    (e.BackendError("decode worker lost"), CODE.INTERNAL, ()),
])
def test_each_router_error_has_its_status_and_metadata(error, code, metadata):
    mapped = service_error(error)
    assert status_of(mapped) is code and trailing_metadata_of(mapped) == metadata
    assert mapped.message == str(error)


def test_anything_else_is_a_bug():
    with pytest.raises(TypeError, match="no gRPC status for KeyError"):
        service_error(KeyError("x"))
