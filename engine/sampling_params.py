"""SamplingParams: how one request's tokens are chosen and when its generation stops.

Torch-free: the router imports this module to validate requests before they reach a worker.
Names and defaults follow vLLM / the OpenAI API. ``validate`` is called once at the service
edge (or by ``LLM.generate``); every error is a ``ValueError`` naming the parameter and value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from engine.structured.params import StructuredOutputsParams

MAX_N = 16  # most parallel samples per request
MAX_LOGPROBS = 20  # most top-N logprobs per position (OpenAI's limit)
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (dividing by them overflows)
LOGPROBS_MODES = ("processed", "raw")
MAX_CACHE_SALT_LEN = 256  # characters of a cache_salt


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters (frozen; derive copies with ``replace``).

    ``temperature`` 0 means greedy (argmax). ``top_k`` 0 or -1 is off. ``max_tokens`` None means
    "until the model's context is full". ``stop`` strings are matched on the detokenized text;
    ``stop_token_ids`` and EOS (unless ``ignore_eos``) stop on the sampled token. While fewer
    than ``min_tokens`` tokens exist, EOS and ``stop_token_ids`` cannot be sampled and stop
    strings are not matched. ``logprobs`` = N returns the sampled token's logprob plus the top
    N of the ``logprobs_mode`` distribution ('processed': after every processor, temperature
    included; 'raw': log_softmax of the model's logits). ``bad_words`` are strings; the engine
    tokenizes them once with ``with_bad_words_tokenized`` into ``bad_words_token_ids``.
    ``cache_salt`` (vLLM / OpenAI's field) goes into every block hash of the request, so requests
    with different salts (tenants) never share cached KV; None shares with every unsalted request.
    ``structured_outputs`` constrains the output to a JSON schema, any JSON object, a regex, one
    of some strings, or a grammar (``engine/structured/params.py``; a dict is read as its fields).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logprobs_mode: str = "processed"
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Normalise the shapes JSON and users hand us; values are checked in validate().
        set_ = object.__setattr__
        if isinstance(self.stop, str):
            set_(self, "stop", [self.stop])
        elif self.stop is None:
            set_(self, "stop", [])
        else:
            set_(self, "stop", list(self.stop))
        set_(self, "stop_token_ids", list(self.stop_token_ids or ()))
        if isinstance(self.bad_words, str):
            set_(self, "bad_words", [self.bad_words])
        for name in ("allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                set_(self, name, list(value))
        if self.structured_outputs is not None:
            set_(self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs))
        if self.logit_bias is not None:  # JSON object keys arrive as strings
            set_(self, "logit_bias", {_int_key(k): v for k, v in dict(self.logit_bias).items()})

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @functools.cached_property
    def logits_unprocessed(self) -> bool:
        """No logprobs asked, and no processor that reads the output or masks tokens by request
        (penalties, logit bias, allowed tokens, a structured-output constraint). Computed once:
        the engine asks it of every row of every step (a frozen instance's fields never change)."""
        return (self.logprobs is None and not self.has_penalties and not self.logit_bias
                and self.allowed_token_ids is None and self.structured_outputs is None)

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @property
    def block_hash_extra_keys(self) -> tuple[str, ...]:
        """The ``extra_keys`` of every block hash of a request with these params
        (``engine.kv_cache.hashing``): the router and the workers must hash with the same."""
        return () if self.cache_salt is None else (self.cache_salt,)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def for_sample(self, index: int) -> SamplingParams:
        """Params for parallel sample ``index`` of ``n``: n=1, and seed+index so that seeded
        samples differ from each other but are reproducible."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """Fill ``bad_words_token_ids``. ``encode(text)`` must not add special tokens. Each word
        is banned as written and with a leading space, since BPE vocabularies spell a word
        differently at the start of the text and after a space."""
        if not self.bad_words:
            return self
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = list(encode(variant))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return dataclasses.replace(self, bad_words_token_ids=sequences)

    def resolve_max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """The number of tokens this request may generate given its prompt."""
        room = max_model_len - prompt_len
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def validate(self, vocab_size: int, max_model_len: int, prompt_len: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter and its value."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            _check_finite(name, getattr(self, name))
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))

        if not 1 <= self.n <= MAX_N:
            _fail("n", self.n, f"must be in [1, {MAX_N}]")
        if self.temperature < 0:
            _fail("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            _fail("top_k", self.top_k, "must be >= -1 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                _fail(name, getattr(self, name), "must be in [-2, 2]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            _fail("seed", self.seed, "must fit in 64 bits")

        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be >= 1")
        if self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if prompt_len is not None:
            if self.max_tokens is not None and prompt_len + self.max_tokens > max_model_len:
                raise ValueError(
                    f"prompt length {prompt_len} + max_tokens {self.max_tokens} = "
                    f"{prompt_len + self.max_tokens} exceeds the model's context length "
                    f"{max_model_len}; shorten the prompt or lower max_tokens")
            if prompt_len >= max_model_len:
                raise ValueError(f"prompt length {prompt_len} leaves no room to generate in the "
                                 f"model's context length {max_model_len}")

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                _fail(name, value, f"must be in [0, {MAX_LOGPROBS}]")
        if self.logprobs_mode not in LOGPROBS_MODES:
            _fail("logprobs_mode", self.logprobs_mode, f"must be one of {LOGPROBS_MODES}")

        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                _check_token_id("logit_bias", token_id, vocab_size)
                _check_finite(f"logit_bias[{token_id}]", bias)
                if abs(bias) > MAX_ABS_LOGIT_BIAS:
                    _fail(f"logit_bias[{token_id}]", bias,
                          f"must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                _fail("allowed_token_ids", [], "must not be empty (None allows every token)")
            for token_id in self.allowed_token_ids:
                _check_token_id("allowed_token_ids", token_id, vocab_size)
        for token_id in self.stop_token_ids:
            _check_token_id("stop_token_ids", token_id, vocab_size)
        for sequence in self.bad_words_token_ids or ():
            if not sequence:
                _fail("bad_words_token_ids", sequence, "must not contain an empty sequence")
            for token_id in sequence:
                _check_token_id("bad_words_token_ids", token_id, vocab_size)

        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str) or not self.cache_salt:
                _fail("cache_salt", self.cache_salt, "must be a non-empty string (or None)")
            if len(self.cache_salt) > MAX_CACHE_SALT_LEN:
                _fail("cache_salt", f"<{len(self.cache_salt)} characters>",
                      f"must be at most {MAX_CACHE_SALT_LEN} characters")

        if self.structured_outputs is not None:
            self.structured_outputs.validate()  # StructuredOutputError (a ValueError) naming its field

        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str) or not stop:
                _fail(f"stop[{i}]", stop, "must be a non-empty string")
        for i, word in enumerate(self.bad_words or ()):
            if not isinstance(word, str) or not word.strip():
                _fail(f"bad_words[{i}]", word, "must be a non-empty string")


def _fail(name: str, value: object, requirement: str) -> NoReturn:
    raise ValueError(f"{name} {requirement}, got {value!r}")


def _check_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, value, "must be a number")
    if not math.isfinite(value):
        _fail(name, value, "must be finite")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "must be an integer")


def _check_token_id(name: str, token_id: object, vocab_size: int) -> None:
    _check_int(f"{name} token id", token_id)
    assert isinstance(token_id, int)  # for the type checker: _check_int raised otherwise
    if not 0 <= token_id < vocab_size:
        _fail(name, token_id, f"token ids must be in [0, {vocab_size}) (the vocabulary size)")


def _int_key(key: object) -> object:
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return key  # validate() reports it
    return key
