"""GrammarMatcher: state is a function of the output tokens; drafts are tried and rolled back."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.structured.bitmask import bitmask_width, unpack_bitmask
from engine.structured.params import StructuredOutputsParams as S
from engine.structured.protocol import NO_MATCHER

EOS = 2


@pytest.fixture(scope="module")
def choice(compiler):
    return compiler.compile(S(choice=["yes", "no way"]))


def allowed(matcher, vocab_size, drafts=()):
    bitmask = torch.zeros(len(drafts) + 1, bitmask_width(vocab_size), dtype=torch.int32)
    matcher.fill(bitmask, 0, drafts)
    return [set(row.nonzero().flatten().tolist()) for row in unpack_bitmask(bitmask, vocab_size)]


def ids(tokenizer, text):
    return tokenizer.encode(text)


def test_the_mask_follows_the_tokens_and_allows_only_eos_at_the_end(tokenizer, choice):
    vocab = tokenizer.vocab_size
    matcher = choice.matcher(SamplingParams(), (EOS,))
    first = allowed(matcher, vocab)[0]
    assert ids(tokenizer, "yes")[0] in first and ids(tokenizer, "no")[0] in first
    assert EOS not in first and ids(tokenizer, "maybe")[0] not in first
    matcher.sync(ids(tokenizer, "yes"))
    assert allowed(matcher, vocab) == [{EOS}]
    matcher.sync([*ids(tokenizer, "yes"), EOS])  # terminated: still only the stop tokens
    assert allowed(matcher, vocab) == [{EOS}]


def test_stop_token_ids_count_as_stop_tokens(tokenizer, choice):
    matcher = choice.matcher(SamplingParams(stop_token_ids=[7]), (EOS,))
    matcher.sync(ids(tokenizer, "yes"))
    assert allowed(matcher, tokenizer.vocab_size) == [{EOS, 7}]


def test_a_rewritten_history_is_replayed_from_the_start(tokenizer, choice):
    vocab = tokenizer.vocab_size
    fresh = choice.matcher(SamplingParams(), (EOS,))
    matcher = choice.matcher(SamplingParams(), (EOS,))
    no_way = ids(tokenizer, "no way")
    matcher.sync(ids(tokenizer, "yes"))
    matcher.sync(no_way[:1])  # shorter and different: a replay
    fresh.sync(no_way[:1])
    assert allowed(matcher, vocab) == allowed(fresh, vocab)


def test_num_valid_stops_at_the_first_refused_draft_and_keeps_the_state(tokenizer, choice):
    vocab = tokenizer.vocab_size
    matcher = choice.matcher(SamplingParams(), (EOS,))
    before = allowed(matcher, vocab)
    yes = ids(tokenizer, "yes")
    assert matcher.num_valid([*yes, EOS, 5]) == len(yes) + 1
    assert matcher.num_valid([ids(tokenizer, "maybe")[0], *yes]) == 0
    assert allowed(matcher, vocab) == before
    assert NO_MATCHER.num_valid([1, 2, 3]) == 3


def test_fill_with_drafts_gives_each_position_its_mask(tokenizer, compiler):
    vocab = tokenizer.vocab_size
    grammar = compiler.compile(S(regex="ab|ac"))
    a, b, c = (ids(tokenizer, x)[0] for x in "abc")
    matcher = grammar.matcher(SamplingParams(), (EOS,))
    rows = allowed(matcher, vocab, [a, b])
    assert a in rows[0] and b not in rows[0]
    assert rows[1] == {b, c} or {b, c} <= rows[1]
    assert rows[2] == {EOS}
    # a refused draft: the rows after it admit everything (verification rejects it anyway)
    rows = allowed(matcher, vocab, [b, a])
    assert b not in rows[0] and len(rows[1]) == len(rows[2]) == vocab
    assert allowed(matcher, vocab)[0] == allowed(grammar.matcher(SamplingParams(), (EOS,)), vocab)[0]


def test_a_refused_token_ends_the_request_instead_of_the_engine(tokenizer, choice):
    matcher = choice.matcher(SamplingParams(), (EOS,))
    matcher.sync(ids(tokenizer, "maybe"))
    assert allowed(matcher, tokenizer.vocab_size) == [{EOS}]
