"""Settings declared once: a dataclass's fields become command-line flags with ``PDSERVE_*`` twins.

    @dataclass(frozen=True)
    class KVStoreFlags:
        kvstore_gib: float = setting(1.0, "capacity in GiB of block bytes")
        transfer: str = setting("nixl", "KV transport", choices=TRANSFERS)

    add_flags(parser, KVStoreFlags)          # --kvstore-gib (PDSERVE_KVSTORE_GIB), --transfer ...
    flags = flags_from(KVStoreFlags, parser.parse_args())

One flag per field, named after it (``kvstore_gib`` -> ``--kvstore-gib``), typed by its
annotation (``int | None`` parses int), with the field's default, ``help`` and ``choices`` from
``setting``; a ``bool`` field is a switch (``flag="--no-x"`` for one that is on by default).
Precedence: command line > environment > default (services/common/settings.py). EngineArgs'
fields use the same metadata, so the engine's flags come from the same table
(services/common/engine_flags.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from services.common.settings import add_env_argument

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a settings dataclass


def setting(default: Any, help_text: str, *, choices: Sequence[Any] | None = None,
            flag: str | None = None) -> Any:
    """A dataclass field that is also a flag (module docstring)."""
    metadata: dict[str, Any] = {"help": help_text}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if flag is not None:
        metadata["flag"] = flag
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field[Any]) -> str:
    """The flag of a field: ``metadata['flag']``, else ``--`` + its name with dashes."""
    return str(field.metadata.get("flag", "--" + field.name.replace("_", "-")))


def fields_with_types(settings: type) -> list[tuple[dataclasses.Field[Any], type]]:
    """Each field of ``settings`` with the type its flag parses (``int | None`` -> int)."""
    hints = typing.get_type_hints(settings)
    typed = []
    for field in dataclasses.fields(settings):
        kinds = [t for t in typing.get_args(hints[field.name]) if t is not type(None)]
        typed.append((field, kinds[0] if kinds else hints[field.name]))
    return typed


def add_flags(parser: argparse.ArgumentParser, settings: type,
              environ: Mapping[str, str] | None = None, **defaults: Any) -> None:
    """One flag (and env twin) per field of the dataclass ``settings``; ``defaults`` replace
    the fields' own (a role's default port, say)."""
    for field, kind in fields_with_types(settings):
        default = defaults.get(field.name, field.default)
        options: dict[str, Any] = {"default": default, "help": field.metadata["help"]}
        if kind is bool:
            options["action"] = "store_false" if default else "store_true"
        else:
            options["type"] = kind
            if "choices" in field.metadata:
                options["choices"] = field.metadata["choices"]
        add_env_argument(parser, flag_name(field), dest=field.name, environ=environ, **options)


def flags_from(settings: type[T], namespace: argparse.Namespace) -> T:
    """The ``settings`` instance of a namespace parsed by a parser with ``add_flags``."""
    return settings(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(settings)})


def flags_argv(settings: Any) -> list[str]:
    """Flags that give another process ``settings``: one per field that differs from its
    default (a switch alone, other values as ``--flag value``)."""
    argv: list[str] = []
    for field, kind in fields_with_types(type(settings)):
        value = getattr(settings, field.name)
        if value != field.default:
            argv += [flag_name(field)] if kind is bool else [flag_name(field), str(value)]
    return argv
