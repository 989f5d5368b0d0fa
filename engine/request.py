"""A request inside the engine and its token accounting.

Every request carries ``num_tokens`` (prompt + output so far) and ``num_computed_tokens``
(tokens whose KV exists in the cache). Each step the scheduler lets computed catch up to
tokens: a whole prompt, a prefill chunk, one decode token, a prefix-cache hit, draft tokens,
or KV that arrived from a prefill worker are all the same arithmetic.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.structured.protocol import NO_MATCHER

if TYPE_CHECKING:
    import torch

    from engine.kv_cache.hashing import BlockHash
    from engine.sampling.logprobs import PositionLogprobs
    from engine.sampling_params import SamplingParams
    from engine.structured.protocol import MatcherProtocol


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    WAITING_FOR_HOST_KV = "waiting_for_host_kv"  # its prefix loads from the host tier, off the step loop
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    # PREFILL role: the prompt is computed and the first token sampled, and the request goes on
    # on a decode worker; its blocks are held until they are sent. A first token that ends the
    # request is FINISHED_STOPPED or FINISHED_LENGTH instead.
    FINISHED_PREFILLED = "prefilled"

    # identity, as equality is: Enum's own hashes the name in Python, and a status is looked up
    # in FINISHED for every request of every step
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                      RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
                      RequestStatus.FINISHED_PREFILLED})


class TokenView(Sequence[int]):
    """Consecutive token lists read as one sequence without concatenating them: indexing and
    slicing copy only what is read, so per-step readers stay O(slice), not O(context)."""

    __slots__ = ("_parts",)

    def __init__(self, *parts: list[int]) -> None:
        self._parts = parts

    def __len__(self) -> int:
        return sum(len(part) for part in self._parts)

    def __getitem__(self, index: int | slice) -> Any:  # int for an index, list[int] for a slice
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("TokenView slices take no step")
            out: list[int] = []
            offset = 0
            for part in self._parts:
                lo, hi = max(start - offset, 0), min(stop - offset, len(part))
                if lo < hi:
                    out += part[lo:hi]
                offset += len(part)
            return out
        if index < 0:
            index += len(self)
        for part in self._parts:
            if 0 <= index < len(part):
                return part[index]
            index -= len(part)
        raise IndexError("TokenView index out of range")


class Request:
    """Engine-side state of one sequence. Parallel samples (n > 1) are separate Requests."""

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "output_token_ids",
        "num_computed_tokens", "num_cached_tokens", "status", "arrival_time", "generator",
        "block_hashes", "spec_token_ids", "stop_reason", "eos_token_ids", "priority",
        "num_preemptions", "parent_id", "error", "index", "prompt_logprobs", "matcher",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        parent_id: str | None = None,
        index: int = 0,
        matcher: MatcherProtocol = NO_MATCHER,
    ) -> None:
        """``matcher``: its structured-output constraint's (``engine/structured/``; one per
        sample), synced with ``output_token_ids`` wherever they are read for sampling, so it
        follows preemption, resumption and a prefill worker's first token by itself."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.parent_id = parent_id  # the caller's id when this is one of n > 1 samples
        self.index = index  # which of the n samples
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission (for usage stats)
        self.status = RequestStatus.WAITING
        self.block_hashes: list[BlockHash] = []
        self.spec_token_ids: list[int] = []
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.error: str | None = None
        # accumulated over prefill chunks; None at position 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.matcher = matcher

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list (O(context)): hot paths read ``token_view`` instead."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def token_view(self) -> TokenView:
        """prompt + output, readable by index and slice without building the whole list."""
        return TokenView(self.prompt_token_ids, self.output_token_ids)

    @property
    def token_view_with_spec(self) -> TokenView:
        """prompt + output + this step's draft tokens."""
        return TokenView(self.prompt_token_ids, self.output_token_ids, self.spec_token_ids)

    def tokens_with_spec(self, start: int, end: int) -> list[int]:
        """``token_view_with_spec[start:end]`` (0 <= start <= end <= num_tokens_with_spec): what
        a step computes for this request, read for every request of every step, so a range
        inside the prompt or inside the output (a decode step's one token) is sliced directly."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            if end - num_prompt <= len(self.output_token_ids):
                return self.output_token_ids[start - num_prompt:end - num_prompt]
        elif end <= num_prompt:
            return self.prompt_token_ids[start:end]
        out: list[int] = self.token_view_with_spec[start:end]
        return out

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED  # a set lookup: read for every request of every step

    def reset_for_recompute(self) -> None:
        """Its blocks were taken (preempted, or its landed KV evicted): it computes again from
        token 0. Drafts go; a request with no output yet will yield its prompt logprobs again.
        The caller frees the blocks and queues it."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        if self.num_output_tokens == 0:
            self.prompt_logprobs = None
        self.num_preemptions += 1

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
