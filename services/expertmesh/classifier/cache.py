"""The default classifier: trained on the shipped train split and terms on first use, cached beside the embedded
checkpoint (``$EXPERTMESH_HOME`` or ``~/.cache/expertmesh``), one per process.

The cache folder is named by a digest of the training data and settings, so a changed corpus or model
trains afresh instead of reusing a stale model. An exclusive file lock makes a second process that starts
at the same time wait for the first one's model instead of training its own; the model is written to a
staging folder and renamed into place, so a reader never sees half of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import tempfile
import threading
from pathlib import Path

from expertmesh.classifier.corpus import (
    DEFAULT_TRAINING,
    default_training_examples,
    shipped,
)
from expertmesh.classifier.model import FORMAT, QueryClassifier
from expertmesh.classifier.train import TrainConfig, train
from expertmesh.infra.home import home

_lock = threading.Lock()
_default: QueryClassifier | None = None


def default_model_dir() -> Path:
    """Where the default classifier lives (it may not be trained yet)."""
    digest = hashlib.sha256()
    for name in DEFAULT_TRAINING:
        digest.update(shipped(name).read_bytes())
    digest.update(f"{FORMAT}:{TrainConfig().model_dump_json()}".encode())
    return home() / f"classifier-{digest.hexdigest()[:12]}"


def build_default(path: Path) -> Path:
    """Train the default classifier into ``path`` unless it is there already; safe across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "classifier.json").is_file():
            return path
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            train(default_training_examples()).save(staging)
            staging.rename(path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return path


def default_classifier() -> QueryClassifier:
    """The process-wide default classifier (trains it once per machine if the cache lacks it)."""
    global _default
    with _lock:
        if _default is None:
            path = default_model_dir()
            if not (path / "classifier.json").is_file():
                build_default(path)
            _default = QueryClassifier.load(path)
        return _default
