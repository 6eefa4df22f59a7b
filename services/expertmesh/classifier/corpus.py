"""Labelled queries: JSONL files of ``{"text": ..., "domain": ...}`` lines, and the corpus shipped here.

The shipped corpus was written for this project: English and Chinese user prompts in nine domains
(questions, commands, pasted snippets), split 80/20 per domain and language into ``data/train.jsonl`` and
``data/eval.jsonl``. ``data/terms.jsonl`` adds a few lines of topical vocabulary per domain ("isotope
half-life", "lease eviction deposit"): a corpus of a couple of thousand queries cannot mention every topic
of a domain, and these lines teach the words that mark it. The default classifier trains on both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from expertmesh.contracts.errors import ExpertMeshError


class CorpusError(ExpertMeshError):
    """A labelled-query file is missing or has a line that is not a ``{"text", "domain"}`` object."""


@dataclass(frozen=True)
class Example:
    text: str
    domain: str
    line: int = 0  # where it came from in its file, for error messages


#: What the default classifier trains on.
DEFAULT_TRAINING = ("train", "terms")


def shipped(name: str) -> Path:
    """Path of a shipped file: the ``train`` or ``eval`` split, or the ``terms`` (inside the installed package)."""
    return Path(str(resources.files("expertmesh.classifier") / "data" / f"{name}.jsonl"))


def default_training_examples() -> list[Example]:
    return [e for name in DEFAULT_TRAINING for e in load_examples(shipped(name))]


def load_examples(path: str | Path) -> list[Example]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise CorpusError(f"{path}: no such file") from None
    except (IsADirectoryError, UnicodeDecodeError) as err:
        raise CorpusError(f"{path}: not a UTF-8 JSONL file ({type(err).__name__})") from None
    examples = [parse_line(line, path, number) for number, line in enumerate(lines, 1) if line.strip()]
    if not examples:
        raise CorpusError(f"{path}: no labelled queries")
    return examples


def parse_line(line: str, path: Path, number: int) -> Example:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise CorpusError(f"{path}:{number}: not JSON ({err.msg})") from None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("text"), str)
        or not isinstance(record.get("domain"), str)
        or not record["domain"].strip()
    ):
        raise CorpusError(f'{path}:{number}: expected {{"text": string, "domain": non-empty string}}')
    return Example(record["text"], record["domain"], number)
