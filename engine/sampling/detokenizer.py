"""Incremental detokenization and stop-string matching for one sequence (torch-free).

Text is decoded from a sliding window of token ids: ``prefix`` tokens already turned into text
give the context (so tokenizers that glue a leading space to a word decode it right), and the
tokens after ``read`` are new. The new text is released only when it does not end in U+FFFD:
a multi-byte character split across tokens decodes as U+FFFD until its last byte arrives.

A tokenizer that offers ``decode_stream`` (engine/models/tokenizer.py: ``tokenizers``'
``DecodeStream``) decodes each token in one call instead of the window's two; the window is kept
beside it for ``finish``'s flush, and decoding falls back to it should the stream refuse a token.

Stop strings are matched on the text, so they are found across token boundaries. Text that
could still be the start of a stop string is held back from the stream; on a match the text
is cut before the stop string (or after it with include_stop_str_in_output). Invariant: the
concatenated deltas equal ``text`` once the sequence is stopped or finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.sampling_params import SamplingParams

# Prompt tokens decoded as context for the first output tokens.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """``decode``; a tokenizer may also offer ``decode_generated`` (the same for a list of ids
    a model generated, without argument checks) and ``decode_stream`` (one call per token, as
    ``Tokenizer.decode_stream``), which are used when present."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True, frozen=True)
class StopCheck:
    stop_str: str | None = None  # the stop string that matched, if any

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into streamed text; ``update`` then ``get_delta``
    each step, ``finish`` when generation ends for a reason other than a stop string."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._decode = getattr(tokenizer, "decode_generated", tokenizer.decode)
        self.params = params
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        decode_stream = getattr(tokenizer, "decode_stream", None)
        self._step: Callable[[int], str | None] | None = (
            None if decode_stream is None else decode_stream(context, params.skip_special_tokens))
        self._token_ids = context  # the decode window's tokens: context + output
        self._prefix_offset = 0  # window[prefix:read] is already text (or prompt context)
        self._read_offset = len(context)
        self._text = ""
        self._num_released = 0  # characters of _text handed out by get_delta
        self._num_output_tokens = 0
        self._stop_check = StopCheck()
        self._is_finished = False

    @property
    def text(self) -> str:
        """The output text decoded so far; final once stopped or finished."""
        return self._text

    @property
    def is_finished(self) -> bool:
        return self._is_finished

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> StopCheck:
        """Append new output tokens and look for a stop string.

        ``stop_terminated``: the last of ``new_token_ids`` is a stop token (EOS or one of
        stop_token_ids) that ended generation; it is kept out of the text unless
        include_stop_str_in_output, and the detokenizer finishes.
        """
        if self._is_finished:
            raise RuntimeError("IncrementalDetokenizer.update called after the sequence ended")
        token_ids = list(new_token_ids)
        if stop_terminated and token_ids and not self.params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        for token_id in token_ids:  # one at a time: a stop string may end mid-batch
            self._num_output_tokens += 1
            old_len = len(self._text)
            self._token_ids.append(token_id)
            if self._step is None:
                self._decode_new_text()
            else:
                self._step_stream(token_id)
            if self._num_output_tokens >= self.params.min_tokens and self._match_stop(old_len):
                self._is_finished = True
                return self._stop_check
        if stop_terminated:
            self.finish()
        return self._stop_check

    def get_delta(self) -> str:
        """Text released since the last call."""
        end = len(self._text) if self._is_finished else len(self._text) - self._held_back()
        if end <= self._num_released:
            return ""
        delta = self._text[self._num_released:end]
        self._num_released = end
        return delta

    def finish(self) -> None:
        """Generation ended (length, EOS, abort): flush held-back text and, as decoded,
        tokens still waiting for the rest of a character."""
        if self._is_finished:
            return
        if self._read_offset < len(self._token_ids):
            self._decode_new_text(flush=True)
        self._is_finished = True

    def _step_stream(self, token_id: int) -> None:
        """``_decode_new_text`` for the newest token, by the tokenizer's stream; the window
        slides where the stream releases text, as it would have there."""
        assert self._step is not None
        try:
            piece = self._step(token_id)
        except Exception:  # noqa: BLE001 - the stream refused the text (not prefix-stable): the window decodes from here
            self._step = None
            self._decode_new_text()
            return
        if piece is not None:
            self._text += piece
            del self._token_ids[:self._read_offset]
            self._read_offset = len(self._token_ids)

    def _decode_new_text(self, flush: bool = False) -> None:
        skip = self.params.skip_special_tokens
        window = self._token_ids
        prefix_text = self._decode(window[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full_text = self._decode(window[self._prefix_offset:], skip_special_tokens=skip)
        if not flush and (len(full_text) <= len(prefix_text)
                          or full_text.endswith(REPLACEMENT_CHAR)):
            return  # nothing printable yet, or a character is incomplete: wait
        self._text += full_text[len(prefix_text):]
        # Slide the window: what was read becomes the next step's context.
        del self._token_ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _match_stop(self, old_len: int) -> bool:
        """Find the earliest stop string that ends in the newly decoded text; cut there."""
        stops = self.params.stop
        if not stops or len(self._text) == old_len:
            return False
        start = max(0, old_len - self.params.max_stop_str_len + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            index = self._text.find(stop, start)
            while index != -1 and index + len(stop) <= old_len:  # ended before: not new
                index = self._text.find(stop, index + 1)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self._text = self._text[:end]
        self._stop_check = StopCheck(stop)
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        held = 0
        for stop in self.params.stop:
            for length in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:length]):
                    held = length
                    break
        return held
