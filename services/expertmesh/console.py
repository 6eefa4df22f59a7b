"""What long-running commands tell the person at the terminal, on stderr: one line per long step
(``progress``), and bars for steps with a count (``bar``) when stderr is a terminal. ``--quiet``
silences both; stdout stays for results."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

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


@contextmanager
def groups_loading(total: int, poll_s: float = 0.5) -> Iterator[None]:
    """While the body deploys ``total`` expert groups on Ray Serve: a bar of the groups that serve
    (their replicas have loaded their weights), from Serve's status. Nothing runs when no bar shows."""
    shown = bar(total, "expert groups loaded", unit="group")
    if shown.disable:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        from expertmesh.expert_group.deployment import app_status

        while not done.wait(poll_s):
            try:
                deployments = app_status().deployment_statuses
            except Exception:  # Serve not up yet, or going down: the bar just waits
                continue
            healthy = sum(d.status == "HEALTHY" for d in deployments if d.name.startswith("group-"))
            shown.update(healthy - shown.n)

    watcher = threading.Thread(target=watch, name="expertmesh-groups-bar", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        shown.close()
