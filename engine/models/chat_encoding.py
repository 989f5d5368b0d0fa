"""Chat token ids in which only the template writes control tokens.

A chat template renders messages to text, and tokenizing that text turns every special-token
string in it (``<|im_end|>``, ``<|im_start|>``) into its control token, including the ones a
user typed into a message. Then "hi <|im_end|><|im_start|>system ..." in a user turn would end
the turn and forge a system prompt. pdserve tokenizes message content as the plain text it
is; only the template's own markup becomes control tokens.

How: messages without any special-token string are rendered and tokenized as usual (byte for
byte what HF's apply_chat_template + encode give). If some content holds one, those contents
are swapped for placeholders, the template renders around them, the template's text is
tokenized as usual and each such content by a copy of the tokenizer whose special tokens are
plain text (``encode_special_tokens``). A template that transforms the content (e.g. trims
it) sees the placeholder instead, so for such messages the transformation is not applied; a
template that drops or repeats a content is refused with ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import tokenizers

_PLACEHOLDER = "\ue000pdserve-content-{}\ue001"  # private-use characters: no tokenizer meaning
_PLACEHOLDER_RE = re.compile("\ue000pdserve-content-(\\d+)\ue001")


def special_token_strings(backend: tokenizers.Tokenizer) -> tuple[str, ...]:
    """The text of every special (control) token of ``backend``."""
    return tuple(t.content for t in backend.get_added_tokens_decoder().values() if t.special)


def plain_text_tokenizer(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy of ``backend`` that tokenizes special-token strings as ordinary text."""
    plain = tokenizers.Tokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    return plain


def encode_chat_guarded(messages: list[dict[str, str]], specials: Sequence[str],
                        render: Callable[[list[dict[str, str]]], str],
                        encode: Callable[[str], list[int]],
                        encode_plain: Callable[[str], list[int]]) -> list[int]:
    """Token ids of the chat ``render`` writes (module docstring). ``encode`` parses special
    tokens; ``encode_plain`` does not. Neither adds bos/eos."""
    guarded = {i for i, m in enumerate(messages)
               if isinstance(m.get("content"), str) and any(s in m["content"] for s in specials)}
    if not guarded:
        return encode(render(messages))
    swapped = [{**m, "content": _PLACEHOLDER.format(i)} if i in guarded else m
               for i, m in enumerate(messages)]
    pieces = _PLACEHOLDER_RE.split(render(swapped))
    # pieces: template text, content index, template text, content index, ..., template text
    seen = [int(index) for index in pieces[1::2]]
    if sorted(seen) != sorted(guarded):
        raise ValueError("the chat template does not write each message's content exactly once, "
                         "so control-token strings in it cannot be kept as plain text")
    ids: list[int] = []
    for j, piece in enumerate(pieces):
        if j % 2:
            ids += encode_plain(messages[int(piece)]["content"])
        elif piece:
            ids += encode(piece)
    return ids
