"""``infra.cpu_priority``: work run at the lowest CPU priority in a thread of its own, the caller's untouched."""

import os
import threading

import pytest

from expertmesh.infra.cpu_priority import LOWEST, at_lowest_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice values are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_work_runs_at_the_lowest_priority_and_the_caller_keeps_its_own():
    before = _nice()
    assert before < LOWEST  # else the test shows nothing
    seen = at_lowest_priority(lambda: (_nice(), threading.get_native_id()))
    assert seen[0] == LOWEST
    assert seen[1] != threading.get_native_id()  # another thread
    assert _nice() == before
    started = {}
    thread = threading.Thread(target=lambda: started.setdefault("nice", _nice()))
    thread.start()
    thread.join()
    assert started["nice"] == before  # threads the caller starts afterwards: its priority, not the lowest


def test_what_the_work_raises_is_raised_to_the_caller():
    def fail():
        raise ValueError("no checkpoint here")

    with pytest.raises(ValueError, match="no checkpoint here"):
        at_lowest_priority(fail)
    assert _nice() < LOWEST
