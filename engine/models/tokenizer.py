"""Text <-> token ids and the chat template, for GGUF files and HF tokenizer.json alike.

Torch-free on purpose: the router tokenizes and applies chat templates without loading a model.

A GGUF file has no tokenizer.json; it stores llama.cpp's description of the tokenizer as metadata
(``tokenizer.ggml.*``). ``Tokenizer.from_gguf_metadata`` rebuilds a ``tokenizers.Tokenizer`` from it
for byte-level BPE vocabularies (``tokenizer.ggml.model == 'gpt2'``), the kind Llama 3, Qwen2 and
SmolLM use.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from engine.models.chat_encoding import encode_chat_guarded, plain_text_tokenizer, special_token_strings
from engine.models.chat_template import ChatTemplate, check_messages
from engine.models.gguf_file import read_gguf

# llama.cpp's token types (gguf.TokenType); CONTROL and USER_DEFINED tokens are matched whole in text.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Tokens that end an assistant turn in common chat templates. A chat model's GGUF often names the
# document end (<|endoftext|>) as eos, yet a conversation turn ends with one of these.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

# How llama.cpp splits text before BPE, by ``tokenizer.ggml.pre``; names not listed get GPT-2's
# regex (the ByteLevel pre-tokenizer's own), as 'gpt2' and 'default' do. Starcoder-family vocabularies
# (SmolLM included) first cut
# every digit apart (llama.cpp's "\p{N}" pass, HF's Digits(individual_digits=True)); it matters for
# whitespace before a digit: "x  1" keeps its two spaces as one token.
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_REGEX = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what serving needs around it: bos/eos ids and the chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: Sequence[int] = (),
                 chat_template: str | None = None, special_tokens: Mapping[str, str | None] | None = None) -> None:
        self._backend = backend
        # ``decode`` without its checks, for ids a model generated (a list of non-negative ints):
        # the detokenizer calls it twice per streamed token
        self.decode_generated: Callable[..., str] = backend.decode
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._chat_template = chat_template
        # extra names the template may use (unk_token, pad_token), as HF passes them
        self._special_tokens: dict[str, str | None] = dict(special_tokens or {})

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read only the metadata of a GGUF file and build its tokenizer."""
        return cls.from_gguf_metadata(read_gguf(path, with_tensors=False).metadata)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF file's metadata dict (byte-level BPE vocabularies only)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                             "load the model from an HF directory with a tokenizer.json instead")
        tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens, so there is no tokenizer to build")
        token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = _byte_level_bpe(tokens, token_types, metadata.get("tokenizer.ggml.merges") or [])
        backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))

        def token_of(key: str) -> str | None:
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
        backend.post_processor = _bos_eos_processor(
            bos if metadata.get("tokenizer.ggml.add_bos_token", False) else None,
            eos if metadata.get("tokenizer.ggml.add_eos_token", False) else None, backend)
        template = metadata.get("tokenizer.chat_template")
        base_eos = [metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.ggml.eot_token_id")]
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=template,
                   eos_token_ids=end_of_turn_ids([i for i in base_eos if i is not None], backend, template),
                   special_tokens={"unk_token": token_of("unknown_token_id"),
                                   "pad_token": token_of("padding_token_id")})

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Build from an HF directory: tokenizer.json, tokenizer_config.json, chat_template.jinja,
        and the eos ids of config.json / generation_config.json."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json (only fast-tokenizer files are supported)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tokenizer_config = read_json_object(model_dir / "tokenizer_config.json")
        template = _hf_chat_template(model_dir, tokenizer_config)
        special = {name: _token_content(tokenizer_config.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        eos_ids = hf_eos_token_ids(model_dir)
        eos_id = backend.token_to_id(special["eos_token"]) if special["eos_token"] is not None else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        return cls(backend, bos_token=special.pop("bos_token"), eos_token=special.pop("eos_token"),
                   eos_token_ids=end_of_turn_ids(eos_ids, backend, template), chat_template=template,
                   special_tokens=special)

    def save_hf(self, model_dir: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json, which ``from_hf_dir`` reads back (the
        GPU check ships the default model's tokenizer this way to a machine without the GGUF)."""
        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(model_dir / "tokenizer.json"))
        config = {"bos_token": self._bos_token, "eos_token": self._eos_token,
                  "chat_template": self._chat_template}
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The HF ``tokenizers.Tokenizer`` underneath (a grammar engine builds its vocabulary
        from it: ``engine/structured/``). Read it; do not change it."""
        return self._backend

    @property
    def bos_token_id(self) -> int | None:
        return None if self._bos_token is None else self._backend.token_to_id(self._bos_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (the model's eos and, for chat models, the end-of-turn token)."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become their
        single id. ``add_special_tokens`` adds bos (and eos) only where the model asks for them."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (ints, numpy ints alike); ids past the vocabulary decode to nothing."""
        try:
            ids = [operator.index(token_id) for token_id in token_ids]
        except TypeError as error:
            raise ValueError(f"token_ids must be integers: {error}") from error
        negative = next((i for i, token_id in enumerate(ids) if token_id < 0), None)
        if negative is not None:
            raise ValueError(f"token_ids[{negative}] must be a non-negative int, got {ids[negative]}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context: Sequence[int],
                      skip_special_tokens: bool = True) -> Callable[[int], str | None] | None:
        """Streamed decoding of generated ids after ``context`` (the text before them): a function
        that takes the next id and returns the text it completes, or None while there is none
        yet (a character still incomplete, a skipped special token). It is ``tokenizers``'
        ``DecodeStream``, which slides the same window as ``IncrementalDetokenizer``'s own in one
        call per token where that one makes two. None where this ``tokenizers`` has no stream
        that takes a context."""
        try:
            stream = decoders.DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        except (AttributeError, TypeError):  # tokenizers < 0.22
            return None
        return partial(stream.step, self._backend)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": str, "content": str}, ...]) with the model's Jinja template,
        as HF's ``apply_chat_template(..., tokenize=False)`` does."""
        check_messages(messages)
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead of messages")
        return self._compiled_template.render(
            messages, add_generation_prompt,
            {"bos_token": self._bos_token, "eos_token": self._eos_token, **self._special_tokens})

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat. The template writes any bos itself, so none is added.
        Special-token strings inside a message's content stay plain text: only the template
        writes control tokens (engine/models/chat_encoding.py)."""
        check_messages(messages)
        return encode_chat_guarded(
            messages, self._special_token_strings,
            lambda msgs: self.apply_chat_template(msgs, add_generation_prompt),
            self.encode, lambda text: self._plain_backend.encode(text, add_special_tokens=False).ids)

    @cached_property
    def _special_token_strings(self) -> tuple[str, ...]:
        return special_token_strings(self._backend)

    @cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        return plain_text_tokenizer(self._backend)

    @cached_property
    def _compiled_template(self) -> ChatTemplate:
        assert self._chat_template is not None  # apply_chat_template checked it
        return ChatTemplate(self._chat_template)


def end_of_turn_ids(base_ids: Sequence[int], backend: tokenizers.Tokenizer, template: str | None) -> list[int]:
    """``base_ids`` plus the id of each end-of-turn token the chat template writes, without repeats."""
    ids = list(base_ids)
    for token in END_OF_TURN_TOKENS:
        token_id = backend.token_to_id(token)
        if template is not None and token in template and token_id is not None:
            ids.append(token_id)
    return list(dict.fromkeys(ids))


def hf_eos_token_ids(model_dir: str | Path) -> list[int]:
    """eos ids named by config.json and generation_config.json (each an int, a list, or absent)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        value = read_json_object(Path(model_dir) / name).get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    return list(dict.fromkeys(ids))


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    other bytes take the code points from 256 up in order (space is 'Ġ', newline 'Ċ')."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(b for b in range(256) if b not in alphabet):
        alphabet[byte] = chr(256 + offset)
    return alphabet


def _byte_level_bpe(tokens: list[str], token_types: list[int], merges: list[str]) -> tokenizers.Tokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED):
            # kept verbatim: matched whole in the text, never byte-encoded
            added.append(AddedToken(token, special=token_type == _TOKEN_TYPE_CONTROL, normalized=False))
        elif not set(token) <= letters:  # some converters store raw text; respell it in the byte alphabet
            token = "".join(alphabet[byte] for byte in token.encode("utf-8"))
        vocab.setdefault(token, token_id)
    split = [merge.split(" ") for merge in merges]
    bad = next((merge for merge, parts in zip(merges, split) if len(parts) != 2), None)
    if bad is not None:
        raise ValueError(f"GGUF merge {bad!r} is not two space-separated tokens")
    pairs = [(first, second) for first, second in split]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.decoder = decoders.ByteLevel()
    special = [token for token in added if token.special]
    backend.add_special_tokens(special)
    backend.add_tokens([token for token in added if not token.special])
    return backend


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_REGEX:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level  # 'gpt2', 'default' and unknown names: GPT-2's regex


def _bos_eos_processor(bos: str | None, eos: str | None,
                       backend: tokenizers.Tokenizer) -> processors.TemplateProcessing:
    pieces = ([bos] if bos else []) + ["$A"] + ([eos] if eos else [])
    specials = [(token, backend.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=" ".join(pieces), special_tokens=specials)


def _hf_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"  # where recent transformers save it
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when there is no such file. Invalid JSON, or JSON that is
    not an object, is a ValueError naming the file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
