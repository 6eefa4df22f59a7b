"""The embedded default model: a small random-weight Mixtral-style checkpoint
with a byte-level tokenizer, created once and cached, so `make run` and `expertmesh verify` work on a fresh
machine with nothing downloaded.

Cache folder: ``$EXPERTMESH_HOME`` or ``~/.cache/expertmesh``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

from expertmesh.infra.home import home
from expertmesh.models.tiny import make_tiny_checkpoint

# Bump the suffix when the shape or the tokenizer changes, so a stale cache is never reused
# (v2: the tokenizer carries a ChatML chat template, so chat requests work).
NAME = "tiny-mixtral-v2"
SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)


def default_checkpoint() -> Path:
    """Path of the embedded checkpoint, built on first use."""
    return cached(
        home() / NAME, lambda staging: make_tiny_checkpoint("mixtral", staging, seed=0, with_tokenizer=True, **SHAPE)
    )


def cached(path: Path, build: Callable[[Path], object]) -> Path:
    """``path``, after ``build(folder)`` wrote a checkpoint there if none was (atomically: built in a staging
    folder and renamed, so two starts do not race)."""
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build(staging)
        staging.rename(path)
    except OSError:
        if not (path / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
