"""Per-group circuit breakers: a pure state machine on an injected clock."""

from expertmesh.router.dispatch.circuit import BreakerState, CircuitBreakers


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_opens_after_threshold_failures_in_a_row_and_half_opens_after_cooldown():
    clock = Clock()
    breakers = CircuitBreakers(threshold=3, cooldown_s=5, clock=clock)
    breakers.failure("g1")
    breakers.failure("g1")
    breakers.success("g1")  # not in a row
    breakers.failure("g1")
    breakers.failure("g1")
    assert breakers.state("g1") is BreakerState.CLOSED and breakers.avoided(("g1", "g2")) == frozenset()
    breakers.failure("g1")
    assert breakers.state("g1") is BreakerState.OPEN
    assert breakers.avoided(("g1", "g2")) == {"g1"}
    clock.now = 5.0
    assert breakers.state("g1") is BreakerState.HALF_OPEN
    assert breakers.avoided(("g1",)) == frozenset()  # the first step after the cooldown tries it
    assert breakers.avoided(("g1",)) == {"g1"}  # the others keep away until that trial ends


def test_a_failed_trial_reopens_and_a_good_one_closes():
    clock = Clock()
    breakers = CircuitBreakers(threshold=1, cooldown_s=2, clock=clock)
    breakers.failure("g")
    clock.now = 2.0
    assert breakers.avoided(("g",)) == frozenset()
    breakers.failure("g")
    assert breakers.state("g") is BreakerState.OPEN
    clock.now = 3.9
    assert breakers.avoided(("g",)) == {"g"}
    clock.now = 4.0
    assert breakers.avoided(("g",)) == frozenset()
    breakers.success("g")
    assert breakers.state("g") is BreakerState.CLOSED and breakers.avoided(("g",)) == frozenset()


def test_a_trial_that_sent_nothing_expires_so_the_group_is_not_avoided_forever():
    clock = Clock()
    breakers = CircuitBreakers(threshold=1, cooldown_s=2, clock=clock)
    breakers.failure("g")
    clock.now = 2.0
    assert breakers.avoided(("g",)) == frozenset()  # the trial goes to a step with no tokens for g
    clock.now = 3.0
    assert breakers.avoided(("g",)) == {"g"}
    clock.now = 4.0
    assert breakers.avoided(("g",)) == frozenset()


def test_a_group_that_lost_a_hedge_race_opens_at_once_and_half_opens_after_the_cooldown():
    """A hedged-away call is one signal, not one of ``threshold`` failures: each further call to the group
    would cost its step another hedge delay (``CircuitBreakers.slow``)."""
    clock = Clock()
    breakers = CircuitBreakers(threshold=3, cooldown_s=5, clock=clock)
    breakers.slow("g1")
    assert breakers.state("g1") is BreakerState.OPEN and breakers.avoided(("g1", "g2")) == {"g1"}
    clock.now = 5.0
    assert breakers.avoided(("g1",)) == frozenset()  # the trial
    breakers.slow("g1")  # hedged away again: another cooldown
    clock.now = 9.9
    assert breakers.state("g1") is BreakerState.OPEN
    clock.now = 10.0
    breakers.success("g1")
    assert breakers.state("g1") is BreakerState.CLOSED
