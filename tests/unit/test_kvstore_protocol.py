"""kvstore.proto: the service's methods and streaming shapes, and that it reuses kv.proto's
handshake and region (one compat contract for transfers and the kvstore)."""

from __future__ import annotations

from services.common.pb import kv_pb2, kvstore_pb2


def test_kvstore_service_methods_and_streaming_shapes():
    desc = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"]
    assert {m.name: (m.client_streaming, m.server_streaming) for m in desc.methods} == {
        "Handshake": (False, False), "Lookup": (False, False), "Offer": (False, False),
        "Put": (True, False), "Get": (False, True), "PrepareRead": (False, False),
        "Release": (False, False), "GetStats": (False, False)}
    assert kvstore_pb2.DESCRIPTOR.package == "pdserve.v1"
    handshake = desc.methods_by_name["Handshake"]
    assert handshake.input_type is kv_pb2.KVHandshake.DESCRIPTOR
    assert handshake.output_type is kv_pb2.KVHandshake.DESCRIPTOR
    region = kvstore_pb2.KVStorePrepareReadReply.DESCRIPTOR.fields_by_name["region"]
    assert region.message_type is kv_pb2.KVRegion.DESCRIPTOR


def test_put_chunk_round_trip():
    chunk = kvstore_pb2.KVStorePutChunk(header=kvstore_pb2.KVStorePutHeader(
        compat_hash="c" * 64, hashes=[b"\x01" * 32, b"\x02" * 32], parent_hash=b"\x00" * 32,
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8], total_bytes=1024))
    back = kvstore_pb2.KVStorePutChunk.FromString(chunk.SerializeToString())
    assert back == chunk and back.HasField("header")
    assert not kvstore_pb2.KVStorePutChunk(offset=4, data=b"x").HasField("header")
