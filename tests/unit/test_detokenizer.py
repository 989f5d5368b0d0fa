"""IncrementalDetokenizer: streaming text, split UTF-8 characters, stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling.detokenizer import IncrementalDetokenizer, StopCheck
from engine.sampling_params import SamplingParams

EOS, NEWLINE = 0, 16
PIECES = {
    EOS: b"<eos>", 1: b"Hello", 2: b" wor", 3: b"ld", 4: b"\xc3", 5: b"\xa9",  # 4+5 = "é"
    6: b"##", 7: b"#", 8: b"END", 9: b" ", 10: b"S", 11: b"TO", 12: b"P", 13: b"!",
    14: b"\xe2\x82", 15: b"\xac",  # 14+15 = "€" (three bytes over two tokens)
    NEWLINE: b"\n",
}
SPECIAL = {EOS}


class ToyTokenizer:
    """Byte pieces joined and decoded with errors='replace', like a byte-level BPE."""

    def decode(self, token_ids, skip_special_tokens=True):
        data = b"".join(PIECES[t] for t in token_ids if not (skip_special_tokens and t in SPECIAL))
        return data.decode("utf-8", errors="replace")


class LeadingSpaceDroppingTokenizer(ToyTokenizer):
    """Like SentencePiece: a decoded text never starts with a space."""

    def decode(self, token_ids, skip_special_tokens=True):
        text = super().decode(token_ids, skip_special_tokens)
        return text[1:] if text.startswith(" ") else text


def stream(token_ids, prompt=(1,), tokenizer=None, per_update=1, **params):
    """Feed tokens ``per_update`` at a time; returns (deltas, detokenizer, last StopCheck)."""
    detok = IncrementalDetokenizer(tokenizer or ToyTokenizer(), list(prompt),
                                   SamplingParams(**params))
    deltas, check = [], StopCheck()
    for i in range(0, len(token_ids), per_update):
        check = detok.update(token_ids[i:i + per_update])
        deltas.append(detok.get_delta())
        if check.is_stopped:
            break
    else:
        detok.finish()
        deltas.append(detok.get_delta())
    return deltas, detok, check


def test_plain_stream_concatenates_to_the_text():
    deltas, detok, check = stream([1, 2, 3, 9, 4, 5, 13])
    assert deltas == ["Hello", " wor", "ld", " ", "", "é", "!", ""]
    assert "".join(deltas) == detok.text == "Hello world é!"
    assert not check.is_stopped


def test_split_multibyte_characters_are_held_until_complete():
    deltas, detok, _ = stream([14, 15, 4, 5, 1])
    assert deltas == ["", "€", "", "é", "Hello", ""]
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_split_across_two_tokens():
    deltas, detok, check = stream([1, 7, 7, 1], stop="##")
    assert check == StopCheck("##") and check.is_stopped
    assert deltas == ["Hello", "", ""]  # '#' is held back: it may start '##'
    assert "".join(deltas) == detok.text == "Hello" and detok.is_finished


def test_stop_string_split_across_three_tokens():
    deltas, detok, check = stream([1, 9, 10, 11, 12, 1], stop=["STOP"])
    assert check.stop_str == "STOP"
    assert deltas == ["Hello", " ", "", "", ""]  # 'S', 'STO' held back, then cut
    assert "".join(deltas) == detok.text == "Hello "
    for d in deltas:
        assert "S" not in d


def test_held_back_text_is_released_when_the_stop_does_not_complete():
    deltas, detok, check = stream([10, 11, 1, 10], stop="STOP")
    assert deltas == ["", "", "STOHello", "", "S"]  # the last 'S' flushes on finish()
    assert "".join(deltas) == detok.text == "STOHelloS" and not check.is_stopped


def test_include_stop_str_in_output():
    deltas, detok, check = stream([1, 10, 11, 12, 1], stop="STOP", include_stop_str_in_output=True)
    assert check.stop_str == "STOP"
    assert "".join(deltas) == detok.text == "HelloSTOP"


def test_stop_string_with_a_split_multibyte_character():
    deltas, detok, check = stream([1, 4, 5, 13, 1], stop="é!")
    assert check.stop_str == "é!" and detok.text == "Hello" == "".join(deltas)
    assert all("\ufffd" not in d and "é" not in d for d in deltas)


def test_stop_in_the_middle_of_a_multi_token_update_drops_the_rest():
    deltas, detok, check = stream([1, 7, 7, 2, 3], stop="##", per_update=5)
    assert check.stop_str == "##" and deltas == ["Hello"] and detok.text == "Hello"


def test_earliest_stop_string_wins():
    deltas, detok, check = stream([1, 10, 11, 12], per_update=4, stop=["TOP", "STOP", "lo"])
    assert check.stop_str == "lo" and detok.text == "Hel" == "".join(deltas)
    _, detok, check = stream([2, 10, 11, 12], per_update=4, stop=["TOP", "STOP"])
    assert check.stop_str == "STOP" and detok.text == " wor"


def test_stop_strings_are_not_matched_before_min_tokens():
    # The first '##' completes at token 2: ordinary text, even once min_tokens is reached
    # and the search window (as long as 'STOP') still covers it.
    deltas, detok, check = stream([7, 7, 1, 6], stop=["##", "STOP"], min_tokens=3)
    assert check.stop_str == "##"
    assert "".join(deltas) == detok.text == "##Hello"


def test_stop_token_from_the_engine_is_kept_out_of_the_text():
    params = SamplingParams(stop_token_ids=[NEWLINE])
    detok = IncrementalDetokenizer(ToyTokenizer(), [1], params)
    detok.update([2, 3])
    detok.update([NEWLINE], stop_terminated=True)
    assert detok.is_finished and detok.text == " world"
    params = params.replace(include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(ToyTokenizer(), [1], params)
    detok.update([2, 3, NEWLINE], stop_terminated=True)
    assert detok.text == " world\n" == detok.get_delta()


def test_eos_and_special_tokens():
    deltas, detok, _ = stream([1, EOS])
    assert detok.text == "Hello"
    _, detok, _ = stream([1, EOS], skip_special_tokens=False)
    assert detok.text == "Hello<eos>"


def test_finish_flushes_an_incomplete_character_and_held_text():
    deltas, detok, _ = stream([1, 10, 4], stop="STOP")
    assert deltas == ["Hello", "", "", "S\ufffd"]
    assert "".join(deltas) == detok.text


def test_prompt_context_keeps_the_leading_space_of_the_first_token():
    deltas, detok, _ = stream([2, 3], prompt=[1], tokenizer=LeadingSpaceDroppingTokenizer())
    assert "".join(deltas) == detok.text == " world"


def test_update_after_stop_is_a_bug():
    _, detok, _ = stream([7, 7], stop="##")
    with pytest.raises(RuntimeError, match="after the sequence ended"):
        detok.update([1])


TOKENS = st.lists(st.sampled_from(sorted(PIECES)), max_size=25)
STOPS = st.lists(st.sampled_from(["##", "STOP", "é!", "€", "ld#", "o w", "S"]), max_size=3)


@settings(max_examples=300, deadline=None)
@given(tokens=TOKENS, stops=STOPS, per_update=st.integers(1, 4), include=st.booleans())
def test_streaming_invariants(tokens, stops, per_update, include):
    deltas, detok, check = stream(tokens, prompt=[], stop=stops, per_update=per_update,
                                  include_stop_str_in_output=include)
    full = ToyTokenizer().decode(tokens)
    text = detok.text
    assert "".join(deltas) == text
    assert full.startswith(text)
    if check.is_stopped:
        stop = check.stop_str
        assert text.endswith(stop) if include else full[len(text):].startswith(stop)
        body = text[:-len(stop)] if include else text
        assert not any(s in body for s in stops)  # the first stop string ended the text
    else:
        assert text == full and not any(s in text for s in stops)
