"""The labelled prompts of ``expertmesh probe --labels FILE``: parsing and bounds. Pure: text in, prompts out.

One JSON object per line, ``{"text": "...", "labels": {"gender": "female", "region": "EU"}}``: a prompt and
its *labels*, each a *dimension* (``gender``) with one *value* (``female``). A prompt may carry any of the
file's dimensions; blank lines are skipped. Every bound below is checked and an error names the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from expertmesh.contracts.errors import InvalidRequest

__all__ = ["LabelledPrompt", "MAX_DIMENSIONS", "MAX_LABEL_CHARS", "MAX_PROMPTS", "MAX_VALUES", "parse_labels"]

#: prompts one file may hold (the field report runs ~1,000 per dimension)
MAX_PROMPTS = 10_000
#: distinct dimensions over the whole file
MAX_DIMENSIONS = 16
#: distinct values of one dimension
MAX_VALUES = 64
#: characters of a dimension's name or of a value
MAX_LABEL_CHARS = 64
#: characters of one prompt
MAX_TEXT_CHARS = 16_384
#: bytes of the whole file
MAX_FILE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class LabelledPrompt:
    """A prompt and its labels: dimension -> value, e.g. ``{"gender": "female"}``."""

    text: str
    labels: dict[str, str]
    line: int  # where it came from, for messages


class LabelsError(InvalidRequest):
    """A labelled-prompts file is malformed or past a bound; the message names the file and the line."""


def _label(where: str, kind: str, s: object) -> str:
    if not isinstance(s, str) or not s.strip():
        raise LabelsError(f"{where}: a label's {kind} must be a non-empty string, got {json.dumps(s)}")
    if len(s) > MAX_LABEL_CHARS:
        raise LabelsError(f"{where}: label {kind} {s[:20]!r}... is {len(s)} characters, above {MAX_LABEL_CHARS}")
    if not s.isprintable():
        raise LabelsError(f"{where}: label {kind} {s!r} has characters that do not print")
    return s


def parse_labels(text: str, name: str = "labels") -> list[LabelledPrompt]:
    """The prompts of a labelled-prompts file's ``text`` (``name`` in messages); LabelsError naming the line."""
    prompts: list[LabelledPrompt] = []
    values: dict[str, set[str]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        if len(prompts) == MAX_PROMPTS:
            raise LabelsError(f"{where}: more than {MAX_PROMPTS} prompts; split the file")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise LabelsError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(record, dict) or set(record) - {"text", "labels"}:
            raise LabelsError(f'{where}: expected {{"text": string, "labels": {{dimension: value}}}} and nothing else')
        prompt, labels = record.get("text"), record.get("labels")
        if not isinstance(prompt, str) or not prompt.strip():
            raise LabelsError(f"{where}: text must be a non-empty string")
        if len(prompt) > MAX_TEXT_CHARS:
            raise LabelsError(f"{where}: text is {len(prompt)} characters, above {MAX_TEXT_CHARS}")
        if not isinstance(labels, dict) or not labels:
            raise LabelsError(f'{where}: labels must be a non-empty object such as {{"gender": "female"}}')
        clean = {_label(where, "dimension", d): _label(where, f"value of {d!r}", v) for d, v in labels.items()}
        for dimension, value in clean.items():
            seen = values.setdefault(dimension, set())
            if len(values) > MAX_DIMENSIONS:
                raise LabelsError(f"{where}: dimension {dimension!r} is one more than the {MAX_DIMENSIONS} allowed")
            seen.add(value)
            if len(seen) > MAX_VALUES:
                raise LabelsError(f"{where}: dimension {dimension!r} has more than {MAX_VALUES} values")
        prompts.append(LabelledPrompt(prompt, clean, number))
    if not prompts:
        raise LabelsError(f"{name}: no labelled prompts")
    return prompts
