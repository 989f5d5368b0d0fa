"""The tokenizer built from GGUF metadata or tokenizer.json, against pinned ids and HF transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tokenizers

from engine.models.default_model import default_model_path as find_default_model
from engine.models.loader import load_tokenizer
from engine.models.tokenizer import Tokenizer
from tests.unit._hf import write_tiny_gguf

# Varied text: unicode, emoji (multi-codepoint too), code, whitespace runs, special tokens, numbers.
TEXTS = [
    "Hello world",
    "naïve café, Ünïcödé ẞ — “quotes” and 你好，世界",
    "emoji: 🤗🚀 👍🏽 🇺🇸 ❤️",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "tabs\t\tand   spaces   \n \n  trailing  ",
    "<|im_start|>user\nHi!<|im_end|>\n<|endoftext|>",
    "numbers 1,000,000.50 and 3.14159 and 2024-01-01T12:34:56Z",
    "x = [1, 22, 333]; y = 4444",
    "I'm sure they'll say it's fine; we've seen it'd",
    "a\u00a0b\u200bc\r\nd",
    "   ",
    "",
]
# Whitespace run right before a digit: SmolLM (llama.cpp pre-tokenizer 'smollm', and the original
# tokenizer.json) splits every digit off first, so "  1" keeps "  " as one token (256). HF's GGUF
# tokenizer uses plain GPT-2 splitting for 'smollm' and gives " ", " ", "1" (216, 216, 33) instead.
DIGIT_SPLIT_CASES = {"x  1": [104, 256, 33], "  42": [256, 36, 34], "x 1": [104, 216, 33]}
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "Bye\n\n  now"}],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(find_default_model())


def test_default_tokenizer_properties(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1  # <|im_start|>
    assert tokenizer.eos_token_ids == (2,)  # eos is <|im_end|> itself, the end-of-turn token
    assert tokenizer.token_to_id("<|im_end|>") == 2
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert tokenizer.token_to_id("no such token") is None
    assert "<|im_start|>" in tokenizer.chat_template


def test_pinned_ids(tokenizer):
    assert tokenizer.encode("hello world") == [28120, 905]
    assert tokenizer.encode("<|im_start|>user\nHi!<|im_end|>\n") == [1, 4093, 198, 26843, 17, 2, 198]
    for text, ids in DIGIT_SPLIT_CASES.items():
        assert tokenizer.encode(text) == ids, text


def test_add_special_tokens_follows_the_model(tokenizer, tmp_path):
    # the default model's GGUF says add_bos_token = False
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")
    path = tmp_path / "bos.gguf"
    write_tiny_gguf(path, add_bos=True)
    with_bos = Tokenizer.from_gguf(path)
    assert with_bos.encode("the", add_special_tokens=True) == [with_bos.bos_token_id, 116, 257]
    assert with_bos.encode("the") == [116, 257]


@pytest.mark.parametrize("text", TEXTS + list(DIGIT_SPLIT_CASES))
def test_decode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert tokenizer.decode(ids) == "user\nHi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


def test_decode_rejects_bad_ids(tokenizer):
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        tokenizer.decode([5, -1])
    with pytest.raises(ValueError, match="must be integers"):
        tokenizer.decode(["5"])
    assert tokenizer.decode([np.int64(28120), 905, 10**6]) == "hello world"  # past the vocabulary: nothing


def test_decode_generated_is_decode_for_generated_ids(tokenizer):
    """The detokenizer's unchecked decode: the same text for any list of valid ids, special
    tokens kept or skipped, numpy ints and ids past the vocabulary alike."""
    from engine.sampling.detokenizer import IncrementalDetokenizer
    from engine.sampling_params import SamplingParams

    ids = tokenizer.encode("<|im_start|>user\nHi é 你好 🙂<|im_end|>") + [10**6, 0, 1, 2]
    for skip in (True, False):
        assert tokenizer.decode_generated(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip)
        for i in range(len(ids)):  # every cut, as the detokenizer's window slides
            assert tokenizer.decode_generated(ids[i:], skip_special_tokens=skip) == tokenizer.decode(ids[i:], skip)
    assert tokenizer.decode_generated([np.int64(28120), 905]) == "hello world"
    detok = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams())
    assert detok._decode == tokenizer.decode_generated


def _streamed(tokenizer, prompt, ids, skip=True, window=False):
    """(each update's delta, the text) of IncrementalDetokenizer over ``ids`` one at a time,
    by the tokenizer's stream or, with ``window``, by its own two decodes per token."""
    from engine.sampling.detokenizer import IncrementalDetokenizer
    from engine.sampling_params import SamplingParams

    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
    assert (detok._step is not None) == (tokenizer.decode_stream(prompt, skip) is not None)
    if window:
        detok._step = None
    return _feed(detok, ids), detok.text


def _feed(detok, ids):
    """Each update's delta over ``ids`` one at a time, then finish's."""
    deltas = []
    for token_id in ids:
        detok.update([token_id])
        deltas.append(detok.get_delta())
    detok.finish()
    return [*deltas, detok.get_delta()]


@pytest.mark.parametrize("skip", [True, False])
def test_the_stream_releases_what_the_window_releases(tokenizer, skip):
    """Token by token, the tokenizer's stream hands out the same deltas as the detokenizer's
    own window: multi-byte characters split over tokens, special tokens, ids past the vocabulary,
    an incomplete character flushed at the end, and random ids."""
    if tokenizer.decode_stream([], skip) is None:
        pytest.skip("this tokenizers has no DecodeStream that takes a context")
    rng = np.random.default_rng(0)
    cases = [tokenizer.encode(text) for text in TEXTS] + [
        tokenizer.encode("🙂 é 你好")[:-1] + [10**6, 2, 0],  # ends inside a character
        rng.integers(0, tokenizer.vocab_size, 400).tolist(),
    ]
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Say it."}])
    for ids in cases:
        for context in (prompt, []):
            assert (_streamed(tokenizer, context, ids, skip)
                    == _streamed(tokenizer, context, ids, skip, window=True)), ids
    deltas, text = _streamed(tokenizer, prompt, tokenizer.encode(TEXTS[2]), skip)
    assert "".join(deltas) == text == TEXTS[2]


def test_a_stream_that_refuses_a_token_hands_the_rest_to_the_window(tokenizer):
    """Should the stream raise (a decoder whose text is not prefix-stable), that token and the
    rest decode by the window, and nothing is lost or repeated."""
    from engine.sampling.detokenizer import IncrementalDetokenizer
    from engine.sampling_params import SamplingParams

    text = "naïve café, Ünïcödé and 你好，世界"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    if detok._step is None:
        pytest.skip("this tokenizers has no DecodeStream that takes a context")
    stream, calls = detok._step, []

    def refuses_the_fifth(token_id):
        calls.append(token_id)
        if len(calls) == 5:
            raise RuntimeError("invalid prefix")
        return stream(token_id)

    detok._step = refuses_the_fifth
    assert "".join(_feed(detok, ids)) == detok.text == text
    assert len(calls) == 5 and detok._step is None


def test_encode_rejects_non_text(tokenizer):
    with pytest.raises(ValueError, match="must be a str"):
        tokenizer.encode([1, 2])


def test_chat_template_pinned(tokenizer):
    text = tokenizer.apply_chat_template(CHATS[0])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=False) == text.removesuffix(
        "<|im_start|>assistant\n")
    assert tokenizer.encode_chat(CHATS[0]) == tokenizer.encode(text)
    assert tokenizer.encode_chat(CHATS[0])[:3] == [1, 9690, 198]


@pytest.mark.parametrize("messages, error", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\]\['content'\] must be a str"),
    ([{"role": None, "content": "a"}], r"messages\[0\]\['role'\] must be a str"),
])
def test_bad_messages(tokenizer, messages, error):
    with pytest.raises(ValueError, match=error):
        tokenizer.apply_chat_template(messages)


def _with_template(template: str | None) -> Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=template)


def test_template_features():
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{{ m | tojson }}{% endfor %}{{ eos_token }}")
    messages = [{"role": "user", "content": "é<b>"}, {"role": "a", "content": "2"}, {"role": "b", "content": "3"}]
    assert _with_template(template).apply_chat_template(messages) == (
        '<s>{"role": "user", "content": "é<b>"}{"role": "a", "content": "2"}</s>')


def test_template_errors_are_value_errors():
    with pytest.raises(ValueError, match="no system role allowed"):
        _with_template("{{ raise_exception('no system role allowed') }}").apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(None).apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="not valid Jinja"):
        _with_template("{% for %}").apply_chat_template(CHATS[0])


def test_load_tokenizer_does_not_import_torch():
    code = ("import sys; from engine.models.loader import load_tokenizer; t = load_tokenizer(None); "
            "assert t.encode('hi') == [6004], t.encode('hi'); assert 'torch' not in sys.modules, 'torch imported'")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


# HF transformers as the oracle (slow: loading its GGUF tokenizer takes seconds)

@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    directory, name = os.path.split(find_default_model())
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_hf(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_hf(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected
    assert tokenizer.encode_chat(messages, add_generation_prompt) == hf_tokenizer.encode(
        expected, add_special_tokens=False)


@pytest.mark.slow
def test_hf_directory_tokenizer_equals_hf(hf_tokenizer, tmp_path):
    """tokenizer.json + tokenizer_config.json + chat_template.jinja as HF's save_pretrained writes them."""
    hf_tokenizer.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    for text in TEXTS + list(DIGIT_SPLIT_CASES):  # this tokenizer.json is HF's: no digit split
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
    assert tokenizer.apply_chat_template(CHATS[1]) == hf_tokenizer.apply_chat_template(
        CHATS[1], tokenize=False, add_generation_prompt=True)
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == 49152


def test_save_hf_round_trips_the_default_tokenizer(tmp_path):
    from engine.models.loader import load_tokenizer
    from engine.models.tokenizer import Tokenizer

    tokenizer = load_tokenizer()
    tokenizer.save_hf(tmp_path)
    again = Tokenizer.from_hf_dir(tmp_path)
    text = "The sky is blue. <|im_start|>user\nhi<|im_end|>"
    assert again.encode(text) == tokenizer.encode(text)
    assert (again.bos_token_id, again.eos_token_ids, again.chat_template) == (
        tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.chat_template)
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    assert again.encode_chat(messages) == tokenizer.encode_chat(messages)
