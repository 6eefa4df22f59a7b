"""Canaries of the default routing policy (router/policy/canary.py, serving/canary.py): the split as a pure function
(shares, stickiness, explicit policies, bounds), the automatic stop's judgement, and a RequestRouter's canary without
a model (which policy a request gets, the admin actions and their refusals)."""

import hashlib
import math

import pytest

from expertmesh.contracts.errors import CanaryRefused, InvalidRequest
from expertmesh.router.policy.canary import (
    BASELINE,
    CANDIDATE,
    MAX_SHARE,
    ArmTally,
    CanaryError,
    CanarySpec,
    CanaryState,
    arm_for,
    arm_of,
    canary_spec,
    judge,
    sampled,
)
from expertmesh.router.policy.routing_policy import parse_policy
from expertmesh.serving.request_routing import RequestRouter
from expertmesh.v1 import inference_pb2 as pb

DELTA_GAP = parse_policy("delta_gap", {}, 2, 8)
KEYS = [f"client-{i}" for i in range(4000)]


# -- the split ---------------------------------------------------------------------------------


@pytest.mark.parametrize("share", [0.01, 0.1, 0.25, 0.5])
def test_the_candidate_arm_takes_about_its_share_of_keys(share):
    candidates = sum(arm_of(key, share) == CANDIDATE for key in KEYS)
    # 4000 keys: the binomial's standard deviation is at most 32 keys; 5 of them is far outside chance
    assert abs(candidates - share * len(KEYS)) < 5 * (len(KEYS) * share * (1 - share)) ** 0.5


def test_a_key_keeps_its_arm_and_a_larger_share_only_adds_keys():
    at_10 = {key: arm_of(key, 0.1) for key in KEYS}
    assert at_10 == {key: arm_of(key, 0.1) for key in KEYS}  # sticky: the same key, the same arm
    at_30 = {key: arm_of(key, 0.3) for key in KEYS}
    assert all(at_30[key] == CANDIDATE for key, arm in at_10.items() if arm == CANDIDATE)
    assert sum(a == CANDIDATE for a in at_30.values()) > sum(a == CANDIDATE for a in at_10.values())


def test_the_arm_is_the_keys_sha256_against_the_share():
    for key in ("", "a", "user-1", "ü-é"):
        point = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 2**64  # any router computes the same
        assert arm_of(key, point) == BASELINE and arm_of(key, math.nextafter(point, 1)) == CANDIDATE


def test_a_request_that_names_its_own_policy_is_in_no_arm():
    assert all(arm_for(key, MAX_SHARE, explicit=True) is None for key in KEYS[:200])
    assert {arm_for(key, MAX_SHARE, explicit=False) for key in KEYS[:200]} == {BASELINE, CANDIDATE}


def test_every_n_th_token_is_a_sample():
    assert [i for i in range(10) if sampled(i, 4)] == [0, 4, 8]
    assert not any(sampled(i, 0) for i in range(10))  # an exact arm: nothing to compare


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"share": 0.0}, "share"),
        ({"share": -0.1}, "share"),
        ({"share": MAX_SHARE + 0.01}, "share"),
        ({"share": float("nan")}, "share"),
        ({"share": 0.1, "min_agreement": 1.5}, "min_agreement"),
        ({"share": 0.1, "min_agreement": float("inf")}, "min_agreement"),
        ({"share": 0.1, "min_samples": 0}, "min_samples"),
        ({"share": 0.1, "sample_every": 0}, "sample_every"),
        ({"share": 0.1, "sample_every": 10**6}, "sample_every"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(kwargs, field):
    with pytest.raises(CanaryError) as err:
        canary_spec(DELTA_GAP, **kwargs)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_exact_is_no_candidate():
    with pytest.raises(CanaryError, match="candidate.name: .*other than exact"):
        canary_spec(parse_policy("exact", {}, 2, 8), 0.1)


def test_the_defaults():
    spec = canary_spec(DELTA_GAP, 0.1)
    assert (spec.min_agreement, spec.min_samples, spec.sample_every) == (0.9, 200, 16)


# -- the automatic stop ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "samples, agreeing, stops",
    [
        (0, 0, False),
        (9, 0, False),  # too few samples to judge, however bad
        (10, 9, False),  # at the bound: not below it
        (10, 8, True),
        (1000, 899, True),
        (1000, 900, False),
    ],
)
def test_the_candidate_stops_below_the_bound_once_it_has_its_samples(samples, agreeing, stops):
    spec = CanarySpec(DELTA_GAP, 0.1, min_agreement=0.9, min_samples=10)
    reason = judge(spec, ArmTally(samples=samples, agreeing=agreeing))
    assert (reason is not None) == stops
    if stops:
        assert f"{agreeing} of {samples}" in reason and "below the bound of 90.0%" in reason


# -- a router's canary, without a model ------------------------------------------------------------


def _router() -> RequestRouter:
    return RequestRouter(2, 8, (0, 1), "exact", None, 0.1)


def _arm_keys(share: float) -> tuple[str, str]:
    """A key of each arm at ``share``."""
    return next(k for k in KEYS if arm_of(k, share) == BASELINE), next(k for k in KEYS if arm_of(k, share) == CANDIDATE)


def test_a_default_policy_request_takes_its_keys_arm_and_an_explicit_one_its_own():
    router = _router()
    router.start_canary(pb.RoutingPolicy(name="delta_gap", delta=0.25), 0.5, sample_every=4)
    baseline_key, candidate_key = _arm_keys(0.5)
    routing, ticket = router.route(None, None, lambda: "x", candidate_key)
    assert routing.policy.spec == "delta_gap(delta=0.25,weight_boost=1.2)"
    assert (ticket.arm, ticket.policy, ticket.sample_every) == (CANDIDATE, "delta_gap", 4)
    routing, ticket = router.route(None, None, lambda: "x", baseline_key)
    assert routing is None and ticket.arm == BASELINE and ticket.sample_every == 0  # exact: nothing to sample
    for explicit, name in ((pb.RoutingPolicy(name="exact"), None), (pb.RoutingPolicy(name="dynamic_k"), "dynamic_k")):
        routing, ticket = router.route(explicit, None, lambda: "x", candidate_key)
        assert ticket is None and (routing and routing.policy.name) == name
    # a Score call (no key) is in no canary
    assert router.route(None, None, lambda: "x", None) == (None, None)
    tallies = router.canary.status().tallies
    assert (tallies[BASELINE].requests, tallies[CANDIDATE].requests) == (1, 1)


def test_promote_makes_the_candidate_the_default_and_ends_the_canary():
    router = _router()
    router.start_canary(pb.RoutingPolicy(name="dynamic_k", threshold=0.2), 0.1)
    status = router.end_canary(promote=True)
    assert status.state is CanaryState.PROMOTED and "was exact" in status.reason
    assert router.default.spec == "dynamic_k(threshold=0.2)"
    routing, ticket = router.route(None, None, lambda: "x", _arm_keys(0.1)[0])
    assert routing.policy.spec == "dynamic_k(threshold=0.2)" and ticket is None
    with pytest.raises(CanaryRefused, match="no canary is running .state: promoted"):
        router.end_canary(promote=False)


def test_stop_leaves_the_default_and_a_later_canary_starts_afresh():
    router = _router()
    router.start_canary(pb.RoutingPolicy(name="delta_gap"), 0.5)
    router.route(None, None, lambda: "x", "k")
    assert router.end_canary(promote=False).state is CanaryState.STOPPED
    assert router.default.is_exact and router.route(None, None, lambda: "x", "k") == (None, None)
    status = router.start_canary(pb.RoutingPolicy(name="dynamic_k"), 0.5)
    assert status.state is CanaryState.RUNNING and sum(t.requests for t in status.tallies.values()) == 0


def test_the_candidate_stops_itself_once_its_samples_fall_below_the_bound():
    router = _router()
    router.start_canary(pb.RoutingPolicy(name="delta_gap"), 0.5, min_agreement=0.75, min_samples=4, sample_every=1)
    _, ticket = router.route(None, None, lambda: "x", _arm_keys(0.5)[1])
    for agreed in (True, True, False):
        ticket.sample(agreed)
    assert router.canary.status().state is CanaryState.RUNNING  # 3 samples: not judged yet
    ticket.sample(False)
    status = router.canary.status()
    assert status.state is CanaryState.AUTO_STOPPED and "2 of 4 sampled tokens (50.0%)" in status.reason
    assert router.route(None, None, lambda: "x", _arm_keys(0.5)[1]) == (None, None)
    with pytest.raises(CanaryRefused, match="auto_stopped"):
        router.end_canary(promote=True)
    assert router.default.is_exact


@pytest.mark.parametrize(
    "candidate, share, field, words",
    [
        (pb.RoutingPolicy(name="no_such_rule"), 0.1, "candidate.name", "unknown policy 'no_such_rule'"),
        (pb.RoutingPolicy(), 0.1, "candidate.name", "name the candidate policy"),
        (pb.RoutingPolicy(name="delta_gap", delta=7), 0.1, "candidate.delta", "must be a number in [0, 1]"),
        (pb.RoutingPolicy(name="delta_gap", tau=0.5), 0.1, "candidate.tau", "parameter of gate_temperature"),
        (pb.RoutingPolicy(name="delta_gap"), 0.9, "share", "must be in (0, 0.5]"),
    ],
)
def test_a_bad_start_is_an_invalid_request_naming_the_setting(candidate, share, field, words):
    router = _router()
    with pytest.raises(InvalidRequest) as err:
        router.start_canary(candidate, share)
    assert err.value.field == field and words in str(err.value)
    assert router.canary.status().state is None


def test_a_second_start_is_refused_while_one_runs():
    router = _router()
    router.start_canary(pb.RoutingPolicy(name="delta_gap"), 0.1)
    with pytest.raises(CanaryRefused, match="a canary of delta_gap.* is running; promote or stop it first"):
        router.start_canary(pb.RoutingPolicy(name="dynamic_k"), 0.1)
    assert router.canary.status().spec.candidate.name == "delta_gap"
