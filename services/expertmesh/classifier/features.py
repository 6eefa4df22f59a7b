"""Text -> hashed n-gram features: the only place that reads a query's characters.

A query becomes a bag of hashed feature ids (``buckets`` of them in all):

- Latin-script words (letters and digits, digits folded to ``0`` so numbers count by shape) as whole words,
  their character 3-5-grams with ``<``/``>`` boundaries (fastText subwords: ``integrals`` shares most of its
  grams with ``integral``, and a misspelling still hits), and word bigrams;
- runs of CJK characters (Chinese, Japanese kana, Hangul), which have no spaces, as character 1-3-grams, so
  Chinese needs no word segmenter and nothing is downloaded;
- runs of symbols (``=>``, ``{}``, ``$$``) as tokens of their own, which is most of what marks code and math.

Ids come from CRC-32 (stable across processes, unlike ``hash``) masked to ``buckets``; collisions are the
price of a fixed model size. Very long queries keep their head and tail, where the instruction usually is, so
featurising costs a bounded time.
"""

from __future__ import annotations

import re
import unicodedata
import zlib

from pydantic import BaseModel, ConfigDict, Field

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
_TOKEN = re.compile(rf"(?P<cjk>[{_CJK}]+)|(?P<word>[^\W{_CJK}]+)|(?P<sym>[^\w\s]+)")
_DIGIT = re.compile(r"\d")
_LONGEST_WORD = 24  # longer "words" (hashes, base64) add grams without adding meaning
_LONGEST_SYMBOLS = 6


class FeatureConfig(BaseModel):
    """How text is cut into features; saved with a model, since a model only understands its own ids."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    buckets_log2: int = Field(18, ge=8, le=24, description="feature ids are hashed into 2**buckets_log2 buckets")
    char_ngrams: tuple[int, int] = Field((3, 5), description="shortest and longest subword of a Latin word")
    cjk_ngrams: tuple[int, int] = Field((1, 3), description="shortest and longest n-gram of a CJK run")
    max_chars: int = Field(1024, ge=64, description="longer text keeps its first 3/4 and last 1/4 of this many")

    @property
    def buckets(self) -> int:
        return 1 << self.buckets_log2


def feature_ids(text: str, config: FeatureConfig) -> list[int]:
    """The hashed ids of every feature of ``text``, repeats included (a repeat counts twice)."""
    mask = config.buckets - 1
    return [zlib.crc32(f.encode()) & mask for f in features(text, config)]


def features(text: str, config: FeatureConfig) -> list[str]:
    """The feature strings of ``text``; the first letter of each names its kind, so kinds never share an id."""
    if len(text) > config.max_chars:
        head = config.max_chars * 3 // 4
        text = text[:head] + "\n" + text[-(config.max_chars - head) :]
    text = _DIGIT.sub("0", unicodedata.normalize("NFKC", text).lower())
    out: list[str] = []
    previous = ""
    lo, hi = config.char_ngrams
    clo, chi = config.cjk_ngrams
    for match in _TOKEN.finditer(text):
        kind = match.lastgroup
        token = match.group()
        if kind == "cjk":
            out.extend("h" + token[i : i + n] for n in range(clo, chi + 1) for i in range(len(token) - n + 1))
            previous = ""
            continue
        if kind == "word":
            token = token[:_LONGEST_WORD]
            out.append("w" + token)
            padded = f"<{token}>"
            out.extend("c" + padded[i : i + n] for n in range(lo, hi + 1) for i in range(len(padded) - n + 1))
        else:
            token = token[:_LONGEST_SYMBOLS]
            out.append("s" + token)
        if previous:
            out.append(f"b{previous} {token}")
        previous = token
    return out
