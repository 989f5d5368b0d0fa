"""``pdserve generate``'s structured-output flags: each sets one kind of
``SamplingParams.structured_outputs`` (the wire reads it back as the engine's params)."""

from __future__ import annotations

import pytest

from engine.structured.params import StructuredOutputsParams
from services.common.wire import params_from_proto
from services.router.client import build_request, parse_args


@pytest.mark.parametrize("flags, expected", [
    ([], None),
    (["--regex", "[0-9]+"], StructuredOutputsParams(regex="[0-9]+")),
    (["--choice", "yes", "--choice", "no"], StructuredOutputsParams(choice=["yes", "no"])),
    (["--json-object"], StructuredOutputsParams(json_object=True)),
    (["--json-schema", '{"type": "object"}'], StructuredOutputsParams(json='{"type": "object"}')),
    (["--grammar", 'root ::= "a"'], StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_each_flag_sends_its_constraint(flags, expected):
    request = build_request(parse_args(["Say it", "--max-tokens", "4", *flags]))
    assert params_from_proto(request.sampling_params).structured_outputs == expected
    assert request.sampling_params.max_tokens == 4


def test_two_constraints_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["x", "--regex", "a", "--json-object"])
    assert "not allowed with argument" in capsys.readouterr().err
