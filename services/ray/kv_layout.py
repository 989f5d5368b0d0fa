"""The KV layout a role's flags give its engine: what a prefill and a decode worker must share.

Workers exchange blocks only when their :class:`KVCompat` (engine/kv_transfer/base.py) is
equal; the KV handshake refuses a pair that differs, but only once a request needs a transfer.
Ray's builder checks it before anything starts, from the flags alone::

    layout = KVLayout.of_argv(["--model", "m.gguf", "--kv-cache-dtype", "int8"])
    layout.check_matches(KVLayout.of_argv([...decode's flags...]))   # ValueError naming flags

The flags are parsed by the engine's own flag table (services/common/engine_flags.py) into
EngineArgs and built into the EngineConfig a worker would run, over a stand-in model shape
(both roles load the same ``--model``, so their shapes agree when their ``--model`` does).
Each KVCompat field is then read from that config (``CacheConfig`` first, then
``ModelConfig``; ``model_name`` is the model's ``name``), so a field added to KVCompat is
compared here with no edit; one the config does not hold is a constant of the code (the
layout version) and keeps its default. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from engine.args import EngineArgs
from engine.config import CacheConfig, EngineConfig, ModelConfig, Role
from engine.kv_transfer.base import KVCompat
from services.common.engine_flags import add_engine_arguments, engine_args_from, flag_of

# KVCompat fields whose config attribute has another name.
ALIASES = {"model_name": "name"}
# The shape of a model nobody loads: the same for both sides, so only --model tells them apart.
STAND_IN_MODEL = ModelConfig(architecture="llama", vocab_size=1, hidden_size=1,
                             intermediate_size=1, num_layers=1, num_heads=1, num_kv_heads=1,
                             head_dim=1)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


@dataclass(frozen=True)
class KVLayout:
    """The KVCompat fields one set of flags decides (``values``), and the flags' settings."""

    values: dict[str, Any]
    model: str | None
    engine_args: EngineArgs

    @classmethod
    def of_argv(cls, argv: Sequence[str]) -> KVLayout:
        """From ``pdserve serve prefill|decode`` flags (others than the engine's are ignored;
        no environment variable is read). ValueError for a bad engine flag or value."""
        parser = _Parser(add_help=False, allow_abbrev=False)
        add_engine_arguments(parser, environ={})
        namespace, _ = parser.parse_known_args(list(argv))
        return cls.of(engine_args_from(namespace), namespace.model)

    @classmethod
    def of(cls, engine_args: EngineArgs, model: str | None) -> KVLayout:
        config = engine_args.build(dataclasses.replace(STAND_IN_MODEL, name=model or ""),
                                   Role.DECODE)
        return cls(kv_layout_values(config), model, engine_args)

    def check_matches(self, other: KVLayout, sides: tuple[str, str] = ("prefill", "decode")) -> None:
        """ValueError naming each differing field, both sides' values and the flags behind it."""
        mine, theirs = sides
        diffs = [f"{name} is {value!r} for {mine}, {other.values[name]!r} for {theirs}"
                 for name, value in self.values.items() if value != other.values[name]]
        if diffs:
            raise ValueError(f"{mine} and {theirs} must build the same KV layout (one compat "
                             f"hash): {'; '.join(diffs)} (set by "
                             f"{', '.join(self._flags_behind(other))})")

    def _flags_behind(self, other: KVLayout) -> list[str]:
        """The differing flags whose value alone, taken from the other side, changes either
        side's layout."""
        flags = ["--model"] if self.model != other.model else []
        for setting in dataclasses.fields(EngineArgs):
            if getattr(self.engine_args, setting.name) != getattr(other.engine_args, setting.name):
                if self._decided_by(setting.name, other) or other._decided_by(setting.name, self):
                    flags.append(flag_of(setting))
        return flags

    def _decided_by(self, name: str, other: KVLayout) -> bool:
        """Does this layout change with ``other``'s value of the EngineArgs field ``name``?"""
        theirs = dataclasses.replace(self.engine_args, **{name: getattr(other.engine_args, name)})
        return KVLayout.of(theirs, self.model).values != self.values


def kv_layout_values(config: EngineConfig) -> dict[str, Any]:
    """Each KVCompat field's value in ``config`` (module docstring); a field the config does
    not hold keeps KVCompat's default."""
    values: dict[str, Any] = {}
    for compat_field in dataclasses.fields(KVCompat):
        name = ALIASES.get(compat_field.name, compat_field.name)
        for source in (config.cache, config.model):
            if hasattr(source, name):
                values[compat_field.name] = getattr(source, name)
                break
        else:
            values[compat_field.name] = compat_field.default
    return values


def constant_fields() -> list[str]:
    """KVCompat fields no config setting decides (the code's own constants)."""
    held = {f.name for f in dataclasses.fields(CacheConfig) + dataclasses.fields(ModelConfig)}
    return [f.name for f in dataclasses.fields(KVCompat) if ALIASES.get(f.name, f.name) not in held]
