"""The embedded default model: a small random-weight Mixtral-style checkpoint
with a byte-level tokenizer, created once and cached, so `make run` and `expertmesh verify` work on a fresh
machine with nothing downloaded.

Cache folder: ``$EXPERTMESH_HOME`` or ``~/.cache/expertmesh``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from expertmesh.tiny import make_tiny_checkpoint

# Bump the suffix when the shape changes, so a stale cache is never reused.
NAME = "tiny-mixtral-v1"
SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)


def home() -> Path:
    return Path(os.environ.get("EXPERTMESH_HOME") or Path.home() / ".cache" / "expertmesh")


def default_checkpoint() -> Path:
    """Path of the embedded checkpoint, built on first use (atomically, so two starts do not race)."""
    path = home() / NAME
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=path.parent))
    try:
        make_tiny_checkpoint("mixtral", staging, seed=0, with_tokenizer=True, **SHAPE)
        staging.rename(path)
    except OSError:
        if not (path / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
