"""Incremental detokenisation with stop sequences.

Text is released only when it is final: bytes of a UTF-8 character split
across tokens wait for the rest, and text that could be the start of a stop
sequence waits until it either completes the stop (then it is dropped and the
stream ends) or stops matching.
"""

from __future__ import annotations

from typing import Sequence

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


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._released = 0  # characters of the decoded text already handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (maybe empty)."""
        self._ids.append(token_id)
        if self._tokenizer is None:  # a model without a tokenizer streams token ids only
            return ""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
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
        if self.stopped or self._tokenizer is None:
            return ""
        return self._release(self._tokenizer.decode(self._ids, skip_special_tokens=True), None)

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
