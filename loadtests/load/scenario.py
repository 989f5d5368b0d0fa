"""A load scenario: traffic described as data (a small YAML file), never as code.

    scenario = load_scenario("long-context-mix")        # a shipped name, or a path to a .yaml/.json
    scenario.classes[0].prompt_tokens                   # (2000, 2400): inclusive token range

A scenario is a mix of request classes. Each request draws its class by ``weight``, then its
prompt and output lengths uniformly from the class's inclusive ranges (tokens of the served
model's tokenizer). Optional per class:

- ``shared_prefix_tokens`` + ``num_tenants``: every request starts with its tenant's system
  prompt of that many tokens (prefix reuse).
- ``turns``: requests come in conversations of that many turns; turn k resends turns 1..k-1
  (user and scripted assistant messages) and is sent only after turn k-1 finished.
- ``repetitive``: the prompt is a code file and an edit instruction; the answer repeats it.

Bad files raise ValueError naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCENARIO_DIR = Path(__file__).parent / "scenarios"
APIS = ("completions", "chat")


@dataclass(frozen=True)
class RequestClass:
    """One component of the traffic mix; token ranges are inclusive ``(low, high)``."""

    name: str
    weight: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    shared_prefix_tokens: int = 0
    num_tenants: int = 1
    turns: int = 1
    repetitive: bool = False


@dataclass(frozen=True)
class Scenario:
    """``num_requests`` requests of ``classes`` against ``/v1/{api}``."""

    name: str
    description: str
    api: str
    num_requests: int
    classes: tuple[RequestClass, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def shipped_scenarios() -> list[str]:
    """Names of the scenarios shipped in ``loadtests/load/scenarios``."""
    return sorted(path.stem for path in SCENARIO_DIR.glob("*.yaml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a ``.yaml`` / ``.json`` file by path."""
    path = Path(name_or_path)
    if not path.exists():
        path = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ValueError(f"scenario {name_or_path!r}: no such file, and not one of {shipped_scenarios()}")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    return parse_scenario(data, str(path))


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    """Validate a decoded scenario document; ``source`` names it in errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping at the top level")  # noqa: TRY004 (bad input)
    api = data.get("api", "completions")
    if api not in APIS:
        raise ValueError(f"{source}: api must be one of {APIS}, got {api!r}")
    raw_classes = data.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise ValueError(f"{source}: classes must be a non-empty list")
    classes = tuple(_parse_class(raw, f"{source}: classes[{i}]") for i, raw in enumerate(raw_classes))
    if api == "completions" and any(c.turns > 1 for c in classes):
        raise ValueError(f"{source}: turns > 1 needs api: chat")
    num_requests = data.get("num_requests", 32)
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"{source}: num_requests must be a positive integer, got {num_requests!r}")
    return Scenario(name=str(data.get("name", Path(source).stem)), description=str(data.get("description", "")),
                    api=api, num_requests=num_requests, classes=classes)


def _parse_class(raw: Any, where: str) -> RequestClass:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping")  # noqa: TRY004 (bad input)
    unknown = set(raw) - set(RequestClass.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    weight = raw.get("weight", 1.0)
    if not isinstance(weight, (int, float)) or weight <= 0:
        raise ValueError(f"{where}.weight must be a positive number, got {weight!r}")
    counts = {key: raw.get(key, default) for key, default in
              (("shared_prefix_tokens", 0), ("num_tenants", 1), ("turns", 1))}
    for key, value in counts.items():
        if not isinstance(value, int) or value < (0 if key == "shared_prefix_tokens" else 1):
            raise ValueError(f"{where}.{key} must be an integer >= {0 if key == 'shared_prefix_tokens' else 1}, "
                             f"got {value!r}")
    return RequestClass(name=str(raw.get("name", where)), weight=float(weight),
                        prompt_tokens=_token_range(raw.get("prompt_tokens"), f"{where}.prompt_tokens"),
                        output_tokens=_token_range(raw.get("output_tokens"), f"{where}.output_tokens"),
                        repetitive=bool(raw.get("repetitive", False)), **counts)


def _token_range(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, int):
        value = [value, value]
    if (not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) for v in value)
            or not 1 <= value[0] <= value[1]):
        raise ValueError(f"{where} must be a token count or [low, high] with 1 <= low <= high, got {value!r}")
    return value[0], value[1]
