"""The engine's command-line flags, derived from EngineArgs' fields, and the argv that hands
the same settings on to another process.

    add_engine_arguments(parser)                 # --model, --block-size, ..., --spec-method, ...
    args = parser.parse_args()
    engine_args = engine_args_from(args)         # -> EngineArgs
    child = [..., *engine_argv(engine_args)]     # what `pdserve up` gives each engine process

One flag per field, named after it (``num_kv_blocks`` -> ``--num-kv-blocks``), each with its
``PDSERVE_*`` twin (``PDSERVE_NUM_KV_BLOCKS``, see services.common.settings); a switch that is
on by default takes its name from the field's metadata (``--no-prefix-caching``): the same
table as every service's flags (services/common/flags.py). ``--model`` sits next to them:
every process that runs an engine loads one. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from engine.args import EngineArgs
from services.common.flags import add_flags, flag_name, flags_argv, flags_from
from services.common.settings import add_env_argument

MODEL_HELP = "GGUF file or HF model directory (default: the embedded SmolLM2-135M)"


def add_engine_arguments(parser: argparse.ArgumentParser,
                         environ: Mapping[str, str] | None = None) -> None:
    """Add ``--model`` and one flag per EngineArgs field (default: the field's) to ``parser``."""
    add_env_argument(parser, "--model", default=None, help=MODEL_HELP, environ=environ)
    add_flags(parser, EngineArgs, environ)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of a namespace parsed by a parser with ``add_engine_arguments``."""
    return flags_from(EngineArgs, namespace)


def engine_argv(args: EngineArgs) -> list[str]:
    """Flags that give another process ``args``: one per field that differs from its default."""
    return flags_argv(args)


def parse_engine_argv(argv: Sequence[str]) -> EngineArgs:
    """The EngineArgs that ``engine_argv`` wrote (no environment variables read).
    A malformed argv exits like any usage error (SystemExit 2, the reason on stderr)."""
    parser = argparse.ArgumentParser(prog="engine flags", add_help=False)
    add_engine_arguments(parser, environ={})
    return engine_args_from(parser.parse_args(list(argv)))


def flag_of(setting: dataclasses.Field[Any]) -> str:
    """The command-line flag of an EngineArgs field (``num_kv_blocks`` -> ``--num-kv-blocks``)."""
    return flag_name(setting)
