"""Requests of a scenario, generated from the served model's tokenizer and a seed.

    requests = build_requests(scenario, load_tokenizer(None), seed=0)

The same scenario, tokenizer and seed give the same requests, byte for byte, so every target of a
comparison sees identical traffic. Prompts are text (any OpenAI server takes text): words drawn
from the tokenizer's own whole-word vocabulary, cut so the text encodes to the drawn token count.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from loadtests.load.scenario import RequestClass, Scenario


class TextTokenizer(Protocol):
    """What prompt generation needs of a tokenizer (``engine.models.tokenizer.Tokenizer`` fits)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. Exactly one of ``prompt`` (completions) and ``messages`` (chat) is
    set. ``after``: index of the request that must finish before this one is sent (multi-turn)."""

    index: int
    class_name: str
    max_tokens: int
    num_prompt_tokens: int  # client-side count of the text's tokens (the template adds a few in chat)
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    after: int | None = None

    def body(self, model: str) -> dict[str, Any]:
        """The OpenAI request body: greedy, ``ignore_eos`` so lengths are as drawn, usage streamed."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": 0,
                                "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.messages is not None:
            body["messages"] = [{"role": role, "content": content} for role, content in self.messages]
        else:
            body["prompt"] = self.prompt
        return body


class WordSource:
    """Text of an exact token count from the tokenizer's whole-word tokens (`` word``)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        words = []
        for token_id in range(min(tokenizer.vocab_size, 50_000)):
            piece = tokenizer.decode([token_id])
            if len(piece) > 3 and piece[0] == " " and piece[1:].isalpha() and piece[1:].islower():
                words.append(piece)
        if len(words) < 100:
            raise ValueError(f"the tokenizer has only {len(words)} whole-word tokens; need 100 to make prompts")
        self.words = words

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """Words whose encoding is ``num_tokens`` tokens long (within one token at a join)."""
        draft = "".join(rng.choice(self.words) for _ in range(num_tokens + 8)).strip()
        ids = self.tokenizer.encode(draft)[:num_tokens]
        return self.tokenizer.decode(ids).strip()

    def code(self, rng: random.Random, num_tokens: int) -> str:
        """A Python-looking file of about ``num_tokens`` tokens built from vocabulary words."""
        lines: list[str] = []
        while len(self.tokenizer.encode("\n".join(lines))) < num_tokens:
            name, arg = rng.choice(self.words).strip(), rng.choice(self.words).strip()
            lines += [f"def {name}_{rng.randrange(100)}({arg}, value):",
                      f"    if {arg} > {rng.randrange(1000)}:",
                      f"        return {arg} * value + {rng.randrange(100)}",
                      f"    return {name}({arg} - 1, value)", ""]
        ids = self.tokenizer.encode("\n".join(lines))[:num_tokens]
        return self.tokenizer.decode(ids)


_word_sources: weakref.WeakKeyDictionary[TextTokenizer, WordSource] = weakref.WeakKeyDictionary()


def word_source(tokenizer: TextTokenizer) -> WordSource:
    """The tokenizer's WordSource, built once (it decodes the whole vocabulary)."""
    if tokenizer not in _word_sources:
        _word_sources[tokenizer] = WordSource(tokenizer)
    return _word_sources[tokenizer]


def build_requests(scenario: Scenario, tokenizer: TextTokenizer, seed: int,
                   num_requests: int | None = None) -> list[RequestSpec]:
    """``num_requests`` (default: the scenario's) requests in send order; conversations interleave."""
    count = scenario.num_requests if num_requests is None else num_requests
    if count < 1:
        raise ValueError(f"num_requests must be >= 1, got {count}")
    rng = random.Random(seed)
    source = word_source(tokenizer)
    tenants = {c.name: [source.text(rng, c.shared_prefix_tokens) for _ in range(c.num_tenants)]
               for c in scenario.classes if c.shared_prefix_tokens}
    weights = [c.weight for c in scenario.classes]
    requests: list[RequestSpec] = []
    open_conversations: list[tuple[RequestClass, list[tuple[str, str]], int, int]] = []
    while len(requests) < count:
        # continue a conversation half of the time, so turns of different conversations interleave
        if open_conversations and (rng.random() < 0.5 or len(open_conversations) >= 4):
            slot = rng.randrange(len(open_conversations))
            cls, history, turns_left, previous = open_conversations.pop(slot)
        else:
            cls = rng.choices(scenario.classes, weights)[0]
            history, turns_left, previous = [], cls.turns, -1
            if cls.name in tenants:
                history.append(("system", rng.choice(tenants[cls.name])))
        num_prompt = rng.randint(*cls.prompt_tokens)
        max_tokens = rng.randint(*cls.output_tokens)
        if cls.repetitive:
            user = ("Rename every `value` to `amount` in this file and return the whole file:\n\n"
                    + source.code(rng, num_prompt))
        else:
            user = source.text(rng, num_prompt)
        messages = [*history, ("user", user)]
        index = len(requests)
        spec_after = previous if previous >= 0 else None
        num_prompt_tokens = sum(len(tokenizer.encode(text)) for _, text in messages)
        if scenario.api == "chat":
            requests.append(RequestSpec(index, cls.name, max_tokens, num_prompt_tokens,
                                        messages=tuple(messages), after=spec_after))
        else:
            requests.append(RequestSpec(index, cls.name, max_tokens, num_prompt_tokens,
                                        prompt="\n\n".join(text for _, text in messages), after=spec_after))
        if turns_left > 1:
            # the scripted assistant reply: same for every target, as long as the drawn output
            reply = source.text(rng, max_tokens)
            open_conversations.append((cls, [*messages, ("assistant", reply)], turns_left - 1, index))
    return requests
