"""engine/structured/formats.py: the exact patterns admit exactly what ``jsonschema``'s
FormatChecker accepts, over every octet and every day of leap and common years; and the
grammar compiled from the rewritten schema refuses what xgrammar's own format admitted."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from engine.structured.formats import PATTERNS, exact_formats

CHECKER = jsonschema.FormatChecker()
OCTETS = [f"{n:0{width}d}" for width in (1, 2, 3) for n in range(10 ** width)]  # "0".."999", "00".."099", ...


def _agrees(fmt: str, text: str) -> bool:
    return bool(re.fullmatch(PATTERNS[fmt], text)) == CHECKER.conforms(text, fmt)


def test_ipv4_octets_without_leading_zeros():
    assert all(_agrees("ipv4", f"{octet}.1.2.3") and _agrees("ipv4", f"1.2.3.{octet}") for octet in OCTETS)
    for text in ("248.002.3.40", "1.2.3", "1.2.3.4.5", "256.1.1.1", " 1.2.3.4", "1.2.3.4\n"):
        assert _agrees("ipv4", text), text


@pytest.mark.parametrize("year", ["0000", "0001", "0004", "0100", "0400", "1900", "1999", "2000", "2023",
                                  "2024", "2100", "9996", "9999"])
def test_dates_of_leap_and_common_years(year):
    texts = [f"{year}-{month:02d}-{day:02d}" for month in range(14) for day in range(33)]
    assert [t for t in texts if not _agrees("date", t)] == []


def test_the_rewrite_reaches_nested_schemas_and_leaves_the_rest():
    schema = {"type": "object", "properties": {
        "ip": {"type": "string", "format": "ipv4"},
        "days": {"type": "array", "items": {"type": "string", "format": "date"}},
        "id": {"type": "string", "format": "uuid"},
        "mine": {"type": "string", "format": "date", "pattern": "^2024-"},
        "format": {"const": {"format": "ipv4"}}}}
    exact = exact_formats(schema)
    props = exact["properties"]
    assert props["ip"] == {"type": "string", "pattern": PATTERNS["ipv4"]}
    assert props["days"]["items"] == {"type": "string", "pattern": PATTERNS["date"]}
    assert props["id"] == schema["properties"]["id"] and props["mine"] == schema["properties"]["mine"]
    assert props["format"] == {"const": {"format": "ipv4"}}  # data, not a schema
    assert schema["properties"]["ip"]["format"] == "ipv4"  # the caller's schema is untouched


@pytest.mark.parametrize("fmt, loose, good", [("ipv4", "248.002.3.40", "248.2.3.40"),
                                              ("date", "2023-02-29", "2024-02-29")])
def test_the_compiled_grammar_refuses_what_the_loose_format_admitted(fmt, loose, good):
    schema = {"type": "string", "format": fmt}
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), json.dumps(loose))
    grammar = xgr.Grammar.from_json_schema(json.dumps(exact_formats(schema)))
    assert not _is_grammar_accept_string(grammar, json.dumps(loose))
    assert _is_grammar_accept_string(grammar, json.dumps(good))
