"""When a slow group call is hedged: the hedge delay from each group's recent call durations (pure, no
groups; the hedging itself runs against real groups in test_dispatch_faults.py)."""

import pytest

from expertmesh.router.dispatch.hedging import (
    HEDGE_MULTIPLE,
    LATE_MULTIPLE,
    MIN_SAMPLES,
    CallDurations,
    HedgePolicy,
    hedge_delay,
    p99,
    size_class,
)

POLICY = HedgePolicy(min_delay_s=0.05, max_delay_s=0.5)


def test_size_classes_are_powers_of_two_of_the_rows():
    assert [size_class(r) for r in (0, 1, 2, 3, 4, 7, 8, 511, 512)] == [1, 1, 2, 2, 3, 3, 4, 9, 10]


def test_p99_is_the_nearest_rank_below():
    assert p99([0.5]) == 0.5
    assert p99([float(i) for i in range(101)]) == 99.0
    assert p99([float(i) for i in range(20)]) == 18.0  # of 20 calls, the second slowest


@pytest.mark.parametrize(
    "class_p99, delay",
    [
        (None, 0.5),  # nothing known yet: the max
        (0.001, 0.05),  # a GPU's millisecond calls: the min, not 3 ms
        (0.03, HEDGE_MULTIPLE * 0.03),
        (0.4, 0.6),  # the max would hedge a call of this class at 1.25x its p99: 1.5x it
    ],
)
def test_the_delay_is_a_multiple_of_the_p99_within_min_and_max_and_never_under_late_multiple_of_it(class_p99, delay):
    assert hedge_delay(POLICY, class_p99) == pytest.approx(delay)
    if class_p99 is not None:
        assert hedge_delay(POLICY, class_p99) >= LATE_MULTIPLE * class_p99


def test_each_group_and_size_class_has_its_own_delay_and_a_class_unknown_to_a_group_takes_its_peers():
    durations = CallDurations(POLICY)
    for _ in range(MIN_SAMPLES - 1):
        durations.record("g1", 2, 0.02)
    assert durations.delay("g1", 3) == 0.5, "too few calls of the class say nothing"
    durations.record("g1", 3, 0.02)
    assert durations.delay("g1", 2) == pytest.approx(0.06)
    for _ in range(MIN_SAMPLES):
        durations.record("g2", 1, 0.01)
        durations.record("g1", 300, 0.12)
    assert durations.delay("g2", 1) == pytest.approx(0.05)  # 3 x 10 ms is under the min
    assert durations.delay("g1", 256) == pytest.approx(0.36)  # a prefill chunk's own class
    assert durations.delay("g2", 2) == pytest.approx(0.06), "g2's 2-3 row calls: g1's p99 for them"
    assert durations.delay("g3", 1000) == 0.5, "a class no group has answered yet: the max"


def test_the_p99_follows_the_recent_calls():
    durations = CallDurations(POLICY)
    for _ in range(300):
        durations.record("g1", 1, 0.1)
    assert durations.delay("g1", 1) == pytest.approx(0.3)
    for _ in range(300):  # the window has moved on: the group got faster
        durations.record("g1", 1, 0.02)
    assert durations.delay("g1", 1) == pytest.approx(0.06)
