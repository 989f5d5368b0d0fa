"""String formats the grammar engine would enforce too loosely, as exact patterns.

xgrammar 0.2.8 compiles ``"format": "ipv4"`` to octets ``[01]?[0-9]?[0-9] | 2[0-4][0-9] |
25[0-5]``, which admits leading zeros (``"248.002.3.40"``), and ``"format": "date"`` to any day
01-31 of any month (``"2023-02-31"``); JSON Schema validators (``jsonschema``'s FormatChecker:
Python's ``ipaddress`` and ``datetime.date``) reject both. ``exact_formats(schema)`` returns the
schema with each such format replaced by a ``pattern`` that admits exactly the strings those
validators accept, so a constrained reply always validates. A subschema that already has a
``pattern`` keeps its format (a string has one pattern), as does every other format.
"""

from __future__ import annotations

from typing import Any

_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"  # 0-255, no leading zero
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999 (Python's date range)
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"  # 0000 is not a year
PATTERNS = {
    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$",
    "date": (f"^({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
             f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)$"),
}
_DATA = ("const", "enum", "default", "examples")  # values, not schemas: left as they are


def exact_formats(schema: Any) -> Any:
    """``schema`` with every ``format`` in PATTERNS (where no ``pattern`` is set) replaced by its
    exact pattern, at any depth; ``schema`` itself is not changed."""
    if isinstance(schema, list):
        return [exact_formats(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    exact = {key: value if key in _DATA else exact_formats(value) for key, value in schema.items()}
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in PATTERNS and "pattern" not in schema:
        del exact["format"]
        exact["pattern"] = PATTERNS[fmt]
    return exact
