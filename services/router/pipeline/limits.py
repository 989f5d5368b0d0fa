"""Request-size limits the router enforces at its edge, before any worker is touched.

One frozen dataclass holds them; ``pdserve serve router`` derives a flag (and a ``PDSERVE_*``
variable) from each field (``services/router/limit_flags.py``). What each limit answers:

    HTTP body larger than max_body_bytes                      413 request_too_large
    request headers larger than max_header_bytes (together)   431 headers_too_large
    n / best_of, stop strings, logprobs, logit_bias, ...      400 naming the field

``check_limits`` is pure: it takes parsed SamplingParams and raises InvalidRequest naming the
field and the limit; value ranges the engine defines (top_p in (0, 1], token ids inside the
vocabulary, ...) stay ``SamplingParams.validate``'s job. ``context_length_error`` words an
over-long request the way OpenAI (and vLLM) do, so clients that parse it keep working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import MAX_CACHE_SALT_LEN, MAX_LOGPROBS, MAX_N, SamplingParams
from services.router.errors import InvalidRequest

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def _limit(default: int, help_text: str) -> int:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class RequestLimits:
    """Upper bounds on one request; each must be >= 1 (``__post_init__`` checks)."""

    max_body_bytes: int = _limit(8 * 1024 * 1024, "largest HTTP request body, bytes (413 beyond)")
    max_header_bytes: int = _limit(16 * 1024, "largest total size of an HTTP request's header "
                                              "lines, bytes (431 beyond)")
    max_n: int = _limit(MAX_N, f"most completions per request (n, best_of; at most {MAX_N})")
    max_stop_strings: int = _limit(16, "most stop strings per request")
    max_stop_chars: int = _limit(256, "longest stop string, characters")
    max_logprobs: int = _limit(MAX_LOGPROBS, f"most top logprobs per token (logprobs, "
                                             f"top_logprobs, prompt_logprobs; at most {MAX_LOGPROBS})")
    max_logit_bias: int = _limit(1024, "most logit_bias entries per request")
    max_bad_words: int = _limit(128, "most bad_words per request")
    max_token_id_list: int = _limit(8192, "most entries in allowed_token_ids / stop_token_ids")
    max_cache_salt_chars: int = _limit(MAX_CACHE_SALT_LEN, f"longest cache_salt, characters "
                                                           f"(at most {MAX_CACHE_SALT_LEN})")

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        ceilings = {"max_n": MAX_N, "max_logprobs": MAX_LOGPROBS,
                    "max_cache_salt_chars": MAX_CACHE_SALT_LEN}
        for name, ceiling in ceilings.items():
            if getattr(self, name) > ceiling:
                raise ValueError(f"{name} must be at most {ceiling} (the engine's own limit), "
                                 f"got {getattr(self, name)}")


def check_limits(params: SamplingParams, limits: RequestLimits) -> None:
    """Raise InvalidRequest naming the first field of ``params`` beyond ``limits``."""
    _in_range("n", params.n, 1, limits.max_n)
    _at_most("stop", len(params.stop), limits.max_stop_strings, "stop strings")
    for i, stop in enumerate(params.stop):
        if isinstance(stop, str) and len(stop) > limits.max_stop_chars:
            raise InvalidRequest(f"stop[{i}] is {len(stop)} characters; at most "
                                 f"{limits.max_stop_chars} are allowed", "stop")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if isinstance(value, int) and not isinstance(value, bool):
            _in_range(name, value, 0, limits.max_logprobs)
    _at_most("logit_bias", len(params.logit_bias or {}), limits.max_logit_bias, "entries")
    _at_most("bad_words", len(params.bad_words or ()), limits.max_bad_words, "words")
    for name in ("allowed_token_ids", "stop_token_ids"):
        _at_most(name, len(getattr(params, name) or ()), limits.max_token_id_list, "token ids")
    salt = params.cache_salt
    if isinstance(salt, str) and len(salt) > limits.max_cache_salt_chars:
        raise InvalidRequest(f"cache_salt is {len(salt)} characters; at most "
                             f"{limits.max_cache_salt_chars} are allowed", "cache_salt")


def context_length_error(max_model_len: int, num_prompt_tokens: int,
                         max_tokens: int | None, param: str = "messages") -> InvalidRequest:
    """OpenAI's (and vLLM's) ``context_length_exceeded`` error for a request that cannot fit."""
    if max_tokens is None or num_prompt_tokens >= max_model_len:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, your "
                   f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
                   f"input messages.")
    else:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you "
                   f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                   f"messages, {max_tokens} in the completion). Please reduce the length of the "
                   f"messages or completion.")
    return InvalidRequest(message, param, CONTEXT_LENGTH_EXCEEDED)


def _at_most(name: str, value: int, limit: int, unit: str) -> None:
    if value > limit:
        raise InvalidRequest(f"{name} has {value} {unit}; at most {limit} are allowed", name)


def _in_range(name: str, value: object, low: int, limit: int) -> None:
    """Only the upper bound is the router's (worded as SamplingParams.validate words ranges);
    a value below ``low`` or of the wrong type is validate's to name."""
    if isinstance(value, int) and not isinstance(value, bool) and value > limit:
        raise InvalidRequest(f"{name} must be in [{low}, {limit}], got {value}", name)
