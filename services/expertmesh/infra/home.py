"""The expertmesh home: the folder where what is built on first use is cached (the embedded and domain
models, the default classifier): ``$EXPERTMESH_HOME`` or ``~/.cache/expertmesh``."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("EXPERTMESH_HOME") or Path.home() / ".cache" / "expertmesh")
