"""What long-running commands tell the person at the terminal, on stderr: one line per long step
(``progress``), and bars for steps with a count (``bar``) when stderr is a terminal. ``--quiet``
silences both; stdout stays for results."""

from __future__ import annotations

import sys
from typing import Any

_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def progress(message: str) -> None:
    """One line of progress on stderr for long steps (loading, starting groups)."""
    if not _quiet:
        print(f"[expertmesh] {message}", file=sys.stderr, flush=True)


def bar(total: int | None, description: str, unit: str = "it") -> Any:
    """A tqdm progress bar on stderr, shown only when stderr is a terminal and not ``--quiet``
    (the returned bar then accepts ``update`` and ``close`` and prints nothing)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        file=sys.stderr,
        disable=_quiet or not sys.stderr.isatty(),
        leave=False,
        dynamic_ncols=True,
    )
