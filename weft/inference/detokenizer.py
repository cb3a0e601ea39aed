"""Text of a growing completion, a piece per step, for outputs that stream (DELTA, CUMULATIVE).

Decoding a token alone can be wrong: a byte-level token may end mid-character, and some
tokenizers change a token's leading space by what precedes it. So each step decodes a short
window of the latest tokens, with a few earlier ones as context, and emits what the window
adds beyond its context; text ending in an incomplete character ("\ufffd") waits for the next
token. Each step costs two decodes of a few tokens, whatever the completion's length. A fast
tokenizer's steps of one token go through the tokenizers library's DecodeStream instead, which
keeps that window itself: one call into Rust a token, less than half the windows' cost.
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one, as context only


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: context already emitted (or the prompt's)
        self.read_offset = len(self.ids)
        self.text = ""  # everything emitted so far
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust one
        self._stream = None  # its DecodeStream, as far as ids (None: decoded by windows)
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
            pieces = [self._stream.step(self._backend, token) for token in self.ids]  # the prompt's text, not emitted
            if pieces and pieces[-1] is None:  # it ends mid-character: the windows drop that one, the stream not
                self._stream = None

    def add(self, token_ids: list[int], final: bool) -> str:
        """Append this step's tokens; -> the text they complete (all that is left when `final`)."""
        if self._stream is not None and len(token_ids) == 1:
            self.ids += token_ids
            piece = self._stream.step(self._backend, token_ids[0])  # None: an incomplete character
            if piece:
                return self._emitted(piece)
            if not final:
                return ""
        else:
            self._stream = None  # several tokens at once: by windows from here on
            self.ids += token_ids
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        return self._emitted(full[len(prefix) :])

    def _emitted(self, delta: str) -> str:
        """`delta`, the text of ids up to the last, is out: the window of context moves on to it."""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def first_stop(text: str, added: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends within its last `added` characters -> (where it starts, it);
    None if there is none (the text before those characters was searched already)."""
    found = [(at, s) for s in stops if (at := text.find(s, max(0, len(text) - added - len(s) + 1))) >= 0]
    return min(found, key=lambda f: f[0]) if found else None
