"""Wire contracts (protos/pdserve/v1) and their lazy stub generation (services/common/protogen.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import protogen
from services.common.pb import generate_pb2, kv_pb2, worker_pb2

REPO = Path(__file__).resolve().parents[2]


def _methods(module, service: str) -> dict[str, tuple[bool, bool]]:
    """method name -> (client_streaming, server_streaming)."""
    desc = module.DESCRIPTOR.services_by_name[service]
    return {m.name: (m.client_streaming, m.server_streaming) for m in desc.methods}


def test_services_and_streaming_shapes():
    assert _methods(generate_pb2, "GenerateService") == {"Generate": (False, True)}
    assert _methods(worker_pb2, "PrefillService") == {"Prefill": (False, True)}
    assert _methods(worker_pb2, "DecodeService") == {
        "Decode": (False, True), "ReserveBlocks": (False, False), "ReleaseBlocks": (False, False),
        "RenewReservation": (False, False), "Generate": (False, True), "DecodeMany": (True, True)}
    assert _methods(worker_pb2, "WorkerService") == {"GetStats": (False, False)}
    assert _methods(kv_pb2, "KVTransferService") == {
        "Handshake": (False, False), "PushBlocks": (True, False)}
    for module in (generate_pb2, worker_pb2, kv_pb2):
        assert module.DESCRIPTOR.package == "pdserve.v1"


def test_generate_request_round_trip_keeps_presence_and_oneof():
    params = generate_pb2.SamplingParams(
        temperature=0.0, top_k=-1, logit_bias={42: -100.0, 7: 2.5}, stop=["\n\n"],
        stop_token_ids=[2], bad_words=["darn"], allowed_token_ids=[1, 2, 3], min_tokens=2,
        include_stop_str_in_output=True, logprobs=0)
    request = generate_pb2.GenerateRequest(
        model="smollm2", prompt_token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
        sampling_params=params)
    back = generate_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert back == request
    assert back.WhichOneof("input") == "prompt_token_ids"
    sp = back.sampling_params
    # `optional` keeps "set to zero" apart from "unset = engine default".
    assert sp.HasField("temperature") and sp.temperature == 0.0
    assert sp.HasField("logprobs") and not sp.HasField("top_p") and not sp.HasField("seed")
    assert not sp.HasField("max_tokens") and not sp.HasField("skip_special_tokens")
    assert dict(sp.logit_bias) == {42: -100.0, 7: 2.5}

    chat = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="user", content="hi")]))
    chat.prompt = "text"  # setting another member of the oneof clears the chat
    assert chat.WhichOneof("input") == "prompt" and not chat.HasField("chat")


def test_worker_and_kv_messages_carry_their_fields():
    event = worker_pb2.PrefillResponse(request_id="r", first_token=worker_pb2.FirstToken(
        token_id=9, finish_reason=generate_pb2.FINISH_REASON_UNSPECIFIED))
    assert event.WhichOneof("event") == "first_token"
    stats = worker_pb2.WorkerStats(num_free_blocks=3, num_outstanding_prefill_tokens=2**40,
                                   transfer_methods=[worker_pb2.KV_TRANSFER_METHOD_NIXL])
    assert worker_pb2.WorkerStats.FromString(stats.SerializeToString()) == stats
    chunk = kv_pb2.PushBlocksChunk(offset=5, data=b"\x00\x01")
    assert not chunk.HasField("header")


def test_generated_modules_import_through_the_package_path():
    text = (protogen.GEN_DIR / "pdserve" / "v1" / "worker_pb2.py").read_text()
    assert "from services.common.gen.pdserve.v1 import generate_pb2" in text
    assert "from pdserve.v1 import" not in text
    assert protogen.is_fresh()


def _copy_protos(tmp_path: Path) -> Path:
    root = tmp_path / "protos"
    shutil.copytree(REPO / "protos", root)
    return root


_GENERATE = ("import sys; from pathlib import Path; from services.common import protogen; "
             "protogen.ensure_generated(Path(sys.argv[1]), Path(sys.argv[2]))")


def test_concurrent_generation_by_several_processes(tmp_path):
    proto_root, gen_dir = _copy_protos(tmp_path), tmp_path / "gen"
    procs = [subprocess.Popen([sys.executable, "-c", _GENERATE, proto_root, gen_dir], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert protogen.is_fresh(proto_root, gen_dir)
    files = sorted(p.name for p in (gen_dir / "pdserve" / "v1").glob("*.py"))
    assert files == ["__init__.py", "generate_pb2.py", "generate_pb2_grpc.py", "kv_pb2.py",
                     "kv_pb2_grpc.py", "kvstore_pb2.py", "kvstore_pb2_grpc.py", "worker_pb2.py",
                     "worker_pb2_grpc.py"]
    for path in (gen_dir / "pdserve" / "v1").glob("*.py"):
        compile(path.read_text(), str(path), "exec")
    assert not list(gen_dir.glob(".tmp-*")) and not list(gen_dir.glob(".STAMP.*"))


def test_regenerates_when_a_proto_changes_and_keeps_old_stubs_on_error(tmp_path):
    proto_root, gen_dir = _copy_protos(tmp_path), tmp_path / "gen"
    protogen.ensure_generated(proto_root, gen_dir)
    kv = proto_root / "pdserve" / "v1" / "kv.proto"
    kv.write_text(kv.read_text() + "\nmessage AddedLater { uint32 x = 1; }\n")
    assert not protogen.is_fresh(proto_root, gen_dir)
    protogen.ensure_generated(proto_root, gen_dir)
    assert protogen.is_fresh(proto_root, gen_dir)
    assert "AddedLater" in (gen_dir / "pdserve" / "v1" / "kv_pb2.pyi").read_text()
    # protoc ran in a child: its protobuf must not load next to NIXL's (that aborts).
    assert "grpc_tools._protoc_compiler" not in sys.modules

    kv.write_text(kv.read_text() + "\nmessage Broken { nonsense x = 1; }\n")
    with pytest.raises(protogen.ProtoGenError, match="protoc failed"):
        protogen.ensure_generated(proto_root, gen_dir)
    assert not protogen.is_fresh(proto_root, gen_dir)
    assert "AddedLater" in (gen_dir / "pdserve" / "v1" / "kv_pb2.pyi").read_text()
