"""``infra.compute_lanes``: work computed side by side by helper threads and the thread that waits on it.

Real threads and real torch intra-op thread settings; each blocking step has a timeout so a broken lane fails
the test instead of hanging it."""

from __future__ import annotations

import threading

import pytest
import torch

from expertmesh.infra.compute_lanes import ComputeLanes, WorkState, split_threads

TIMEOUT_S = 10.0


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def lanes(two_threads):
    made = ComputeLanes(1, 1, name="test-lane")
    yield made
    made.close()


@pytest.mark.parametrize(
    "threads, parties, expected",
    [(2, 2, (1, 1)), (16, 2, (1, 8)), (2, 1, (0, 2)), (2, 4, (1, 1)), (8, 3, (2, 2)), (1, 2, (0, 1))],
)
def test_split_threads(threads, parties, expected):
    assert split_threads(threads, parties) == expected


def _where() -> tuple[str, int]:
    return threading.current_thread().name, torch.get_num_threads()


def test_a_lone_work_is_left_to_the_thread_that_waits_on_it(lanes):
    """One queued work and no one computing: the lane leaves it, the waiter computes it at all its threads."""
    work = lanes.submit(_where)
    threading.Event().wait(0.3)  # time enough for the lane to wake and (wrongly) take it
    assert work.state is WorkState.QUEUED
    assert lanes.wait(work, TIMEOUT_S)
    assert work.result() == (threading.current_thread().name, 2)


def test_two_works_compute_side_by_side_each_at_its_share(lanes):
    """The lane takes the first, the waiter the second (the one it waits on), and each runs while the other
    does (each waits to see the other started); both at one intra-op thread; the waiter's threads come back."""
    started = [threading.Event(), threading.Event()]

    def both(i: int):
        started[i].set()
        assert started[1 - i].wait(TIMEOUT_S), "the other work never ran beside this one"
        return _where()

    first = lanes.submit(lambda: both(0))
    second = lanes.submit(lambda: both(1))
    assert lanes.wait(second, TIMEOUT_S) and lanes.wait(first, TIMEOUT_S)
    assert first.result() == ("test-lane-0", 1)
    assert second.result() == (threading.current_thread().name, 1)
    assert torch.get_num_threads() == 2


def test_errors_reach_the_result_and_nothing_else(lanes):
    def boom():
        raise ValueError("bad call")

    failing, fine = lanes.submit(boom), lanes.submit(_where)
    assert lanes.wait(failing, TIMEOUT_S) and lanes.wait(fine, TIMEOUT_S)
    with pytest.raises(ValueError, match="bad call"):
        failing.result()
    assert fine.result()[1] >= 1


def test_the_process_default_stays_and_the_lane_keeps_its_own(two_threads):
    lanes = ComputeLanes(1, 1)
    try:
        assert torch.get_num_threads() == 2
        seen = []  # threads started after the lanes take torch's process-wide default, which stays 2
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join(TIMEOUT_S)
        assert seen == [2]
    finally:
        lanes.close()


def test_cancel_drops_queued_work_and_wait_times_out_on_running_work(lanes):
    release = threading.Event()
    blocker = lanes.submit(lambda: release.wait(TIMEOUT_S))
    queued = lanes.submit(_where)
    # the lane takes ``blocker`` (two were queued); ``queued`` stays until someone waits on it
    for _ in range(200):
        if blocker.state is WorkState.RUNNING:
            break
        threading.Event().wait(0.05)
    assert blocker.state is WorkState.RUNNING
    lanes.cancel(queued)
    assert queued.state is WorkState.CANCELLED
    assert lanes.wait(queued, 0.0)
    assert not lanes.wait(blocker, 0.1)  # running on the lane, nothing queued to help with
    release.set()
    assert lanes.wait(blocker, TIMEOUT_S) and blocker.result() is True


def test_after_close_the_waiter_computes_what_is_queued(two_threads):
    lanes = ComputeLanes(1, 1)
    lanes.close()
    works = [lanes.submit(_where) for _ in range(3)]
    assert all(lanes.wait(w, TIMEOUT_S) for w in works)
    assert {w.result()[0] for w in works} == {threading.current_thread().name}


def test_wide_work_runs_on_its_sender_at_once_at_all_the_lanes_threads(lanes):
    """``run_wide`` computes on the calling thread, now, at the lanes' threads and its own together, even from a
    thread narrowed to one (a small engine step); the caller's setting comes back after, and nothing is queued."""
    torch.set_num_threads(1)
    try:
        assert lanes.run_wide(_where) == (threading.current_thread().name, 2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(2)
    assert lanes.run_wide(_where) == (threading.current_thread().name, 2)
    with pytest.raises(ValueError, match="raised"):
        lanes.run_wide(lambda: (_ for _ in ()).throw(ValueError("raised")))
    assert torch.get_num_threads() == 2
