"""Incremental detokenisation with stop sequences.

Text is released only when it is final: bytes of a UTF-8 character split
across tokens wait for the rest, and text that could be the start of a stop
sequence waits until it either completes the stop (then it is dropped and the
stream ends) or stops matching.

Each token decodes only the last few ids (vLLM's incremental detokenizer: prefix
and read offsets), not the whole answer again: the text of the ids up to the read
offset is kept, and the text the ids from the prefix offset on add to what the ids
between the two offsets give is appended. Decoding everything on every token cost
a token O(answer length): with this project's byte-level tokenizer, 42 us a token at
the 256th token, 275 us at the 1024th, 672 us at the 4096th (17.6 ms of the engine's
thread a step at 64 streams at their 1024th token), against ~8 us at any length
decoded this way. A window whose text does not begin with its
first ids' own text (a tokenizer whose decoding of a token depends on what follows
it) is decoded whole instead, so the text is always what ``decode`` of every id
gives.

A transformers tokenizer backed by the Rust ``tokenizers`` library, with no clean-up of spaces to do, is decoded by
that library directly (``_decoder``): what transformers' ``decode`` calls after converting its argument and
checking its options, 0.7 us for a token's two decodes against 4.2 through transformers.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

# Every stop sequence is searched for in the decoded text on each new token, so a
# request's per-token cost grows with how many it sends and how long they are.
#: the most stop sequences one request may set
MAX_STOP_SEQUENCES = 16
#: the longest stop sequence, in bytes of UTF-8
MAX_STOP_BYTES = 256


def stop_problems(stop: Sequence[str]) -> list[str]:
    """What is wrong with a request's stop sequences: too many, too long, or empty (an
    empty one matches everywhere, so it can only be a mistake)."""
    if len(stop) > MAX_STOP_SEQUENCES:
        return [f"stop has {len(stop)} sequences; at most {MAX_STOP_SEQUENCES} are allowed"]
    out = []
    for i, sequence in enumerate(stop):
        size = len(sequence.encode("utf-8"))
        if size == 0:
            out.append(f"stop[{i}] is empty; a stop sequence needs at least one character")
        elif size > MAX_STOP_BYTES:
            out.append(f"stop[{i}] is {size} bytes of UTF-8; at most {MAX_STOP_BYTES} are allowed")
    return out


def _decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``: the Rust tokenizer's own decode where that is
    all transformers' would do (its ``decode`` and ``_decode`` not overridden, no space clean-up asked for)."""
    from transformers import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return partial(tokenizer._tokenizer.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True)


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        #: ids -> text; None for a model without a tokenizer (it streams token ids only)
        self._decode = _decoder(tokenizer) if tokenizer is not None else None
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._released = 0  # characters of the decoded text already handed out
        self.stopped = False
        # The text of ids[:read] is final (``_final``); ids[prefix:read] are the context the next window decodes
        # with, so that its first id decodes as it did in the text before (a leading space kept or dropped alike)
        self._final = ""
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (maybe empty)."""
        self._ids.append(token_id)
        if self._decode is None:
            return ""
        text = self._text()
        # A stop is looked for before an incomplete UTF-8 sequence at the end too: the token that completes
        # a stop may also start a character, and the stream may end before its next byte comes.
        complete = text.rstrip("\ufffd")
        for stop in self._stop:
            at = complete.find(stop, max(0, self._released - len(stop) + 1))
            if at != -1:
                self.stopped = True
                return self._release(complete, at)
        if len(complete) < len(text):  # the incomplete sequence waits for its next byte
            return ""
        hold = max((self._partial_stop(text, s) for s in self._stop), default=0)
        return self._release(text, len(text) - hold)

    def flush(self) -> str:
        """At the end of generation: everything not yet released (held stop prefixes are real text)."""
        if self.stopped or self._decode is None:
            return ""
        return self._release(self._text(), None)

    def _text(self) -> str:
        """``decode`` of every id so far, from a decode of the ids since the prefix offset (see the module)."""
        ids, decode = self._ids, self._decode
        before = decode(ids[self._prefix : self._read])
        window = decode(ids[self._prefix :])
        if not window.startswith(before):  # this tokenizer decodes an id by what follows it: everything, then
            text = decode(ids)
            if not text.endswith("\ufffd"):
                self._final, self._prefix, self._read = text, len(ids) - 1, len(ids)
            return text
        text = self._final + window[len(before) :]
        if len(window) > len(before) and not window.endswith("\ufffd"):  # final: the next window starts here
            self._final, self._prefix, self._read = text, self._read, len(ids)
        return text

    def _release(self, text: str, upto: int | None) -> str:
        upto = len(text) if upto is None else upto
        out = text[self._released : upto] if upto > self._released else ""
        self._released = max(self._released, upto)
        return out

    @staticmethod
    def _partial_stop(text: str, stop: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if stop.startswith(text[-n:]):
                return n
        return 0
