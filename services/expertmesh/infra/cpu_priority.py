"""Work that should take only CPU nobody else wants: run it in a thread at the lowest priority.

Why a thread: on Linux a nice value belongs to a thread, and a thread starts with its creator's. A
process cannot take back a priority it gave up without CAP_SYS_NICE, so lowering the whole process
for its start would leave it serving at the lowest priority; lowering one short-lived thread does
not. A group started beside busy ones (``expertmesh groups add``: 3-4 CPU seconds of imports and
checkpoint reading) then yields the cores to the router and the groups serving requests, and still
serves at normal priority once it is up: the threads that serve are started by the main thread.
Worker pools a library starts as it loads inside the work stay at the lowest priority too: load one
whose pool computes before (``group serve`` loads numpy first: its BLAS starts threads on import).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["LOWEST", "at_lowest_priority"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the lowest CPU priority (the highest nice value) Linux has
LOWEST = 19


def at_lowest_priority(work: Callable[[], T], name: str = "expertmesh-low-priority") -> T:
    """``work()`` in a new thread of this process at nice ``LOWEST``; waits for it and returns its result (or
    raises what it raised). The calling thread's priority is untouched, and so is that of every thread it
    starts later; threads ``work`` itself starts keep the lowest priority (start none that serve). Where a
    thread's priority cannot be set (not Linux, a sandbox refusing it), ``work`` runs at the caller's."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)
        except (AttributeError, OSError) as err:  # not Linux's per-thread nice: no harm, only no yielding
            log.debug("could not lower this thread's CPU priority: %s", err)
        try:
            outcome["value"] = work()
        except BaseException as err:  # handed to the caller, as if work() had run there
            outcome["error"] = err

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
