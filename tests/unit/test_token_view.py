"""TokenView reads like the concatenated list, for every index and slice."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.request import TokenView

lists = st.lists(st.integers(0, 1000), max_size=6)


@given(st.lists(lists, min_size=1, max_size=3), st.integers(-12, 24), st.integers(-12, 24))
def test_matches_concatenation(parts, start, stop):
    whole = [t for part in parts for t in part]
    view = TokenView(*parts)
    assert len(view) == len(whole)
    assert view[start:stop] == whole[start:stop]
    assert view[start:] == whole[start:]
    for i in range(-len(whole), len(whole)):
        assert view[i] == whole[i]


def test_out_of_range_and_stepped_slices_raise():
    view = TokenView([1, 2], [3])
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(IndexError):
        view[-4]
    with pytest.raises(ValueError, match="no step"):
        view[::2]


@given(lists, lists, lists, st.data())
def test_a_request_reads_its_tokens_as_the_view_does(prompt, output, spec, data):
    from engine.request import Request
    from engine.sampling_params import SamplingParams

    request = Request("r", prompt, SamplingParams())
    request.output_token_ids, request.spec_token_ids = list(output), list(spec)
    total = len(prompt) + len(output) + len(spec)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    tokens = request.tokens_with_spec(start, end)
    assert tokens == (prompt + output + spec)[start:end]
    tokens.append(-1)  # a copy: the request's own lists are not the caller's
    assert request.prompt_token_ids == prompt and request.output_token_ids == output
