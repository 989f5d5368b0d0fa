"""The Ray Serve application's args: validated like Ray Serve LLM's PD builder (a transport
named, one KV layout for prefill and decode), each error a ValueError naming the key."""

from __future__ import annotations

import pytest

from services.ray.args import PdserveServingArgs, RoleConfig


def test_defaults_and_deployment_options() -> None:
    args = PdserveServingArgs.from_dict({"transfer": "nixl", "router": {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}})
    assert args.prefill.deployment_options() == {"ray_actor_options": {"num_cpus": 1},
                                                 "num_replicas": 1}
    options = args.router.deployment_options()
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4}
    assert "num_replicas" not in options
    assert args.kvstore is not None and args.kvstore.ray_actor_options == {"num_cpus": 0.1}


def test_yaml_file(tmp_path) -> None:
    path = tmp_path / "app.yaml"
    path.write_text("transfer: grpc\nprefill: {num_replicas: 2, args: [--num-threads, 1]}\n"
                    "kvstore: null\n")
    args = PdserveServingArgs.from_dict(path)
    assert args.prefill.num_replicas == 2 and args.prefill.args == ("--num-threads", "1")
    assert args.kvstore is None


@pytest.mark.parametrize("raw, named", [
    ({}, "transfer"),
    ({"transfer": "pigeon"}, "transfer"),
    ({"transfer": "grpc", "decoder": {}}, "decoder"),
    ({"transfer": "grpc", "decode": {"num_replicas": 0}}, "decode.num_replicas"),
    ({"transfer": "grpc", "decode": {"replicas": 2}}, "decode: unknown keys"),
    ({"transfer": "grpc", "decode": {"num_replicas": 2, "autoscaling_config": {}}}, "exactly one"),
    ({"transfer": "grpc", "prefill": {"args": ["--block-size", "32"]}}, "--block-size"),
    ({"transfer": "grpc", "decode": {"args": ["--dtype=float16"]}}, "--dtype"),
    ({"transfer": "grpc", "kvstore_gib": 0}, "kvstore_gib"),
    ({"transfer": "grpc", "decode": {"autoscaling_config": {"max_replicas": 2}}},
     "decode.autoscaling_config: Serve cannot autoscale"),
])
def test_bad_args_raise_naming_the_key(raw: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PdserveServingArgs.from_dict(raw)


def test_flag_lookup() -> None:
    role = RoleConfig(args=("--block-size", "32", "--model=/m.gguf"))
    assert role.flag("--block-size") == "32" and role.flag("--model") == "/m.gguf"
    assert role.flag("--dtype") is None


def test_replica_args_ignore_scale() -> None:
    one = PdserveServingArgs.from_dict({"transfer": "grpc", "decode": {"args": ["--spec-k", "2"]}})
    two = PdserveServingArgs.from_dict({"transfer": "grpc", "decode": {
        "num_replicas": 2, "ray_actor_options": {"num_cpus": 2}, "args": ["--spec-k", "2"]}})
    assert one.for_replicas() == two.for_replicas()
    assert two.for_replicas().decode is not None and two.for_replicas().decode.args == ("--spec-k", "2")


def test_serve_run_builder_path_builds_the_app() -> None:
    """`serve run services.ray.builder:build_pdserve_app transfer=grpc` calls the builder so."""
    pytest.importorskip("ray.serve")
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from services.ray.builder import build_pdserve_app

    app = call_user_app_builder_with_args_if_necessary(build_pdserve_app, {"transfer": "grpc"})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="transfer"):
        call_user_app_builder_with_args_if_necessary(build_pdserve_app, {})


@pytest.mark.parametrize("config, refusal", [
    ("transfer: grpc\ndecode: {num_replicas: -1}\n", "decode.num_replicas must be >= 1"),
    ("transfer: grpc\nprefill: {args: [--kv-cache-dtype, int8]}\n"
     "decode: {args: [--kv-cache-dtype, fp32]}\n",
     "dtype is 'int8' for prefill, 'float32' for decode (set by --kv-cache-dtype)"),
])
def test_cli_rejects_a_bad_config_before_starting_ray(tmp_path, config: str, refusal: str) -> None:
    import subprocess
    import sys

    from tests.integration.cluster_fixtures import REPO

    path = tmp_path / "app.yaml"
    path.write_text(config)
    result = subprocess.run([sys.executable, "-m", "services.cli", "serve", "ray", "--config",
                             str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and refusal in result.stderr, result

def test_a_kv_cache_dtype_mismatch_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"dtype is 'int8' for prefill, 'float32' for decode "
                                         r"\(set by --kv-cache-dtype\)"):
        PdserveServingArgs.from_dict({"transfer": "grpc",
                                      "prefill": {"args": ["--kv-cache-dtype", "int8"]}})
    with pytest.raises(ValueError, match="set by --dtype, --kv-cache-dtype"):
        PdserveServingArgs.from_dict({"transfer": "grpc",
                                      "prefill": {"args": ["--kv-cache-dtype=fp8"]},
                                      "decode": {"args": ["--dtype", "bfloat16"]}})


def test_flags_that_build_the_same_layout_pass() -> None:
    """Spelled differently, the same cache: auto on fp32 is fp32; other flags may differ."""
    args = PdserveServingArgs.from_dict({"transfer": "grpc", "model": "/m.gguf",
                                         "prefill": {"args": ["--kv-cache-dtype", "fp32",
                                                              "--num-kv-blocks", "64"]},
                                         "decode": {"args": ["--spec-method", "ngram",
                                                             "--reservation-lease-ms", "900"]}})
    assert args.kv_layout("prefill").values == args.kv_layout("decode").values
    assert args.kv_layout("decode").values["dtype"] == "float32"


def test_a_model_mismatch_and_a_bad_engine_flag_name_the_role() -> None:
    with pytest.raises(ValueError, match="model_name is '/a.gguf' for prefill, '/b.gguf' for "
                                         r"decode \(set by --model\)"):
        PdserveServingArgs.from_dict({"transfer": "grpc", "model": "/a.gguf",
                                      "decode": {"args": ["--model", "/b.gguf"]}})
    with pytest.raises(ValueError, match="decode.args: .*--kv-cache-dtype"):
        PdserveServingArgs.from_dict({"transfer": "grpc",
                                      "decode": {"args": ["--kv-cache-dtype", "int9"]}})


def test_every_kv_compat_field_is_read_from_the_engine_config() -> None:
    """A KVCompat field that no CacheConfig / ModelConfig field holds would be compared by its
    default only: the one such field is the code's layout version."""
    from services.ray.kv_layout import constant_fields

    assert constant_fields() == ["layout_version"]
