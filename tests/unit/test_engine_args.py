"""EngineArgs (engine/args.py) and the flags derived from it (services/common/engine_flags.py):
one flag and one PDSERVE_* twin per field, an argv that round-trips, a build that applies every
field, and ``pdserve up`` handing every engine flag to every process that runs an engine."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import pytest

from engine.args import EngineArgs
from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    Role,
    SchedulerConfig,
    SpecConfig,
)
from services.common.engine_flags import (
    add_engine_arguments,
    engine_args_from,
    engine_argv,
    parse_engine_argv,
)
from services.common.settings import env_var_name

MODEL = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_model_len=2048)
# Every field away from its default (test_changed_covers_every_field keeps it so).
CHANGED = EngineArgs(block_size=32, num_kv_blocks=48, kv_cache_memory=100_000_000,
                     enable_prefix_caching=False, max_num_seqs=7, max_num_batched_tokens=256,
                     max_model_len=384, device="cuda", dtype="float16", num_threads=1,
                     spec_method="ngram", spec_k=3, draft_model="/models/draft.gguf",
                     spec_layers=6, spec_max_batch=8, spec_draft_cost=0.5, cpu_offload_gb=0.25,
                     weight_format="fp32", kv_cache_dtype="int8", gpu_memory_utilization=0.5,
                     enforce_eager=True, async_scheduling="off")


def _parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_engine_arguments(parser, environ=environ)
    return parser


def _env_of(argv: list[str]) -> dict[str, str]:
    """The PDSERVE_* variables that say what ``argv`` (flags, each with a value or a switch) says."""
    env, i = {}, 0
    while i < len(argv):
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        env[env_var_name(argv[i])] = argv[i + 1] if has_value else "1"
        i += 2 if has_value else 1
    return env


def test_changed_covers_every_field():
    assert [f.name for f in dataclasses.fields(EngineArgs)
            if getattr(CHANGED, f.name) == f.default] == []


def test_defaults_are_the_config_dataclasses_on_a_cpu():
    assert EngineArgs().build(MODEL, Role.COLOCATED) == EngineConfig(
        model=MODEL, cache=CacheConfig(), scheduler=SchedulerConfig(role=Role.COLOCATED),
        spec=SpecConfig())
    assert EngineArgs().build(MODEL, Role.COLOCATED).cache.memory_budget_bytes == 512 * 1024 * 1024


def test_defaults_follow_a_cuda_device():
    config = EngineArgs(device="cuda").build(MODEL, Role.COLOCATED)
    assert (config.dtype, config.cache.dtype) == ("bfloat16", "bfloat16")
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (256, 8192)
    assert config.cache.gpu_memory_utilization == 0.9  # the KV cache from the GPU's free memory
    assert EngineArgs(device="cuda:1", gpu_memory_utilization=0.5).build(
        MODEL, Role.DECODE).cache.gpu_memory_utilization == 0.5
    given = EngineArgs(device="cuda", kv_cache_memory=2**30, dtype="float32", max_num_seqs=8,
                       max_num_batched_tokens=1024).build(MODEL, Role.DECODE)
    assert (given.cache.gpu_memory_utilization, given.cache.memory_budget_bytes) == (None, 2**30)
    assert (given.dtype, given.scheduler.max_num_seqs, given.scheduler.max_num_batched_tokens) == (
        "float32", 8, 1024)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
            EngineArgs(device="cuda", gpu_memory_utilization=bad).build(MODEL, Role.DECODE)


def test_build_applies_every_field():
    assert CHANGED.build(MODEL, Role.DECODE) == EngineConfig(
        model=dataclasses.replace(MODEL, max_model_len=384),
        cache=CacheConfig(block_size=32, num_blocks=48, memory_budget_bytes=100_000_000,
                          dtype="int8", enable_prefix_caching=False, cpu_offload_bytes=2**28),
        scheduler=SchedulerConfig(max_num_seqs=7, max_num_batched_tokens=256, role=Role.DECODE),
        spec=SpecConfig(method="ngram", k=3, draft_model="/models/draft.gguf", num_layers=6,
                        max_batch=8, draft_cost=0.5),
        device="cuda", dtype="float16", num_threads=1, weight_format="fp32", enforce_eager=True,
        async_scheduling="off")
    assert EngineArgs(device="cuda").build(MODEL, Role.DECODE) != EngineArgs().build(MODEL, Role.DECODE)
    default = EngineArgs(device="cuda").build(MODEL, Role.DECODE)
    for f in dataclasses.fields(EngineArgs):  # none of them is dropped on the way (on CUDA, where all apply)
        one = EngineArgs(**{"device": "cuda", f.name: getattr(CHANGED, f.name)})
        assert f.name == "device" or one.build(MODEL, Role.DECODE) != default, f.name


def test_kv_cache_dtype_names_the_cache_storage():
    dtypes = {value: EngineArgs(kv_cache_dtype=value).build(MODEL, Role.DECODE).cache.dtype
              for value in ("auto", "fp32", "bf16", "int8", "fp8")}
    assert dtypes == {"auto": "float32", "fp32": "float32", "bf16": "bfloat16", "int8": "int8",
                      "fp8": "float8_e4m3fn"}
    assert EngineArgs(dtype="bfloat16").build(MODEL, Role.DECODE).cache.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype must be auto\|fp32\|bf16\|int8\|fp8, got 'int4'"):
        EngineArgs(kv_cache_dtype="int4").build(MODEL, Role.DECODE)


def test_prefill_never_speculates_but_checks_the_spec_flags():
    assert CHANGED.build(MODEL, Role.PREFILL).spec == SpecConfig()
    assert CHANGED.build(MODEL, Role.COLOCATED).spec.method == "ngram"
    with pytest.raises(ConfigError, match="needs a draft model path"):
        EngineArgs(spec_method="draft").build(MODEL, Role.PREFILL)


def test_every_field_is_a_flag_with_its_env_twin():
    assert engine_args_from(_parser({}).parse_args([])) == EngineArgs()
    argv = engine_argv(CHANGED)
    assert engine_args_from(_parser({}).parse_args(argv)) == CHANGED
    assert engine_args_from(_parser(_env_of(argv)).parse_args([])) == CHANGED
    help_text = " ".join(_parser({}).format_help().split())
    for flag in (a for a in argv if a.startswith("--")):
        assert f"[env: {env_var_name(flag)}]" in help_text


def test_command_line_beats_env_beats_default():
    env = {"PDSERVE_NUM_KV_BLOCKS": "48", "PDSERVE_NO_PREFIX_CACHING": "yes"}
    args = engine_args_from(_parser(env).parse_args(["--num-kv-blocks", "64"]))
    assert (args.num_kv_blocks, args.enable_prefix_caching, args.spec_k) == (64, False, 4)
    assert engine_args_from(_parser({"PDSERVE_NO_PREFIX_CACHING": "0"}).parse_args([])) == EngineArgs()


def test_engine_argv_names_only_what_differs_from_the_defaults():
    assert engine_argv(EngineArgs()) == []
    assert engine_argv(EngineArgs(num_kv_blocks=64, enable_prefix_caching=False,
                                  spec_method="ngram", spec_draft_cost=0.25)) == [
        "--num-kv-blocks", "64", "--no-prefix-caching", "--spec-method", "ngram",
        "--spec-draft-cost", "0.25"]
    assert parse_engine_argv(engine_argv(CHANGED)) == CHANGED


def test_a_bad_value_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_engine_argv(["--dtype", "int8"])
    assert exit_info.value.code == 2
    assert "--dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_llm_rejects_an_unknown_engine_keyword():
    from engine.llm import LLM

    with pytest.raises(TypeError, match="num_kv_block"):
        LLM(num_kv_block=4)


# ---- pdserve up: what each child is given -------------------------------------------------

UP = dataclasses.replace(CHANGED, device="cpu", draft_model=None)  # what `up` is given


def _plan(tmp_path, monkeypatch, *up_argv: str):
    from services import launcher

    argv = engine_argv(UP)
    k = argv.index("--spec-k")
    del argv[k:k + 2]
    monkeypatch.setenv("PDSERVE_SPEC_K", "3")  # one flag from the environment: forwarded too
    args = launcher.build_parser().parse_args([*up_argv, *argv])
    monkeypatch.delenv("PDSERVE_SPEC_K")  # the children below see only their argv
    return launcher.plan(args, tmp_path)


def _served(child_argv: list[str]) -> tuple[str, list[str]]:
    """``[-m, services.cli, serve, ROLE, *flags]`` -> (ROLE, flags)."""
    serve = child_argv.index("serve")
    return child_argv[serve + 1], child_argv[serve + 2:]


def test_up_gives_every_engine_flag_to_each_worker_and_the_router(tmp_path, monkeypatch):
    from services.router.__main__ import parse_args as router_args
    from services.worker.settings import worker_parser

    workers, router = _plan(tmp_path, monkeypatch, "--transfer", "grpc", "--pin-cores")
    assert [w.name for w in workers] == ["prefill-0", "decode-0"]
    for worker in workers:
        role, flags = _served(worker.argv)
        parsed = worker_parser(Role(role), 0).parse_args(flags)
        assert engine_args_from(parsed) == UP, role  # --num-threads 1 wins over the core split
    role, flags = _served(router.argv)
    assert role == "router"
    assert engine_args_from(router_args(flags)).max_model_len == 384  # its frontend's limit


def test_up_colocated_gives_every_engine_flag_to_the_router(tmp_path, monkeypatch):
    from services.router.__main__ import parse_args as router_args

    workers, router = _plan(tmp_path, monkeypatch, "--colocated")
    assert workers == []
    role, flags = _served(router.argv)
    parsed = router_args(flags)
    assert (role, parsed.colocated) == ("router", True)
    assert engine_args_from(parsed) == UP


def test_worker_args_come_after_the_engine_flags(tmp_path, monkeypatch):
    from services.worker.settings import worker_parser

    workers, _ = _plan(tmp_path, monkeypatch, "--worker-args", "--num-kv-blocks 64")
    for worker in workers:
        role, flags = _served(worker.argv)
        assert worker_parser(Role(role), 0).parse_args(flags).num_kv_blocks == 64


def test_router_args_come_last_in_the_router_s_flags(tmp_path, monkeypatch):
    from services.router.__main__ import parse_args as router_args

    _, router = _plan(tmp_path, monkeypatch, "--transfer", "grpc",
                      "--router-args", "--local-prefill-max-tokens 100000 --transfer nixl")
    role, flags = _served(router.argv)
    parsed = router_args(flags)
    assert (parsed.local_prefill_max_tokens, parsed.transfer) == (100000, "nixl")
    _, router = _plan(tmp_path, monkeypatch, "--transfer", "grpc")
    assert router_args(_served(router.argv)[1]).local_prefill_max_tokens == 64


def test_every_command_runs_a_module_that_exists():
    from services.cli import COMMANDS

    assert COMMANDS[("serve", "kvstore")] == "services.kvstore.__main__"
    assert {words: module for words, module in COMMANDS.items()
            if importlib.util.find_spec(module) is None} == {}


def test_up_on_one_gpu_gives_each_worker_its_part_of_the_memory(tmp_path, monkeypatch):
    from services import launcher
    from services.worker.settings import worker_parser

    args = launcher.build_parser().parse_args(["--device", "cuda", "--decode", "3", "--transfer", "grpc",
                                               "--gpu-memory-utilization", "0.8"])
    workers, router = launcher.plan(args, tmp_path)
    for worker in workers:  # 1 prefill + 3 decode engines on the one device: 0.2 each
        role, flags = _served(worker.argv)
        assert engine_args_from(worker_parser(Role(role), 0).parse_args(flags)).gpu_memory_utilization == 0.2
    colocated = launcher.build_parser().parse_args(["--device", "cuda", "--colocated"])
    _, router = launcher.plan(colocated, tmp_path)
    from services.router.__main__ import parse_args as router_args

    assert engine_args_from(router_args(_served(router.argv)[1])).gpu_memory_utilization == 0.9  # the one engine
    on_cpu = launcher.build_parser().parse_args(["--decode", "3"])
    assert launcher.gpu_share(engine_args_from(on_cpu), 4) == engine_args_from(on_cpu)
