"""The benchmarks' prompts (loadtests/prompts.py) share no prefix block and repeat by seed."""

from __future__ import annotations

import pytest

from loadtests.prompts import FIRST_BLOCK_TOKENS, distinct_prompts


@pytest.fixture(scope="module")
def tokenizer(loaded_model):
    return loaded_model.tokenizer


@pytest.mark.parametrize("length, count", [(24, 16), (196, 32), (128, 256)])
def test_no_two_prompts_share_a_first_block(tokenizer, length, count):
    batch = distinct_prompts(tokenizer, length, count, salt=7)
    assert [len(ids) for ids in batch] == [length] * count
    assert len({tuple(ids[:FIRST_BLOCK_TOKENS]) for ids in batch}) == count


def test_the_same_arguments_give_the_same_prompts_and_salts_differ(tokenizer):
    assert distinct_prompts(tokenizer, 64, 4, salt=1) == distinct_prompts(tokenizer, 64, 4, salt=1)
    assert not set(map(tuple, distinct_prompts(tokenizer, 64, 4, salt=1))) & set(
        map(tuple, distinct_prompts(tokenizer, 64, 4, salt=2)))


def test_a_prompt_is_ordinary_text(tokenizer):
    (ids,) = distinct_prompts(tokenizer, 32, 1)
    assert all(word.isalpha() for word in tokenizer.decode(ids).split())
