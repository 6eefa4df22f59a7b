"""Domain-aware placement: the planner's optional affinity input (pure; no processes)."""

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.bench.placement import (
    affinity_cases,
    grid_topology,
    run_affinity_case,
    sampled_groups_per_token,
    synthetic_domains,
    synthetic_stats,
)
from expertmesh.contracts.errors import InputError
from expertmesh.orchestrator.placement.affinity import (
    DomainAffinity,
    affinity_from_counts,
    affinity_to_dict,
    groups_per_token,
    parse_affinity_json,
)
from expertmesh.orchestrator.placement.planner import PlanOptions, plan
from expertmesh.orchestrator.placement.quality import gpu_loads
from expertmesh.orchestrator.placement.stats import LoadStats

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _affinity(q: np.ndarray, mix: np.ndarray) -> DomainAffinity:
    return DomainAffinity(tuple(f"d{d}" for d in range(q.shape[1])), q, mix)


@st.composite
def skewed(draw):
    """A domain-skewed workload, its affinity, a topology and options (tolerance 0 included)."""
    topo = grid_topology(draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 4)))
    G = topo.num_gpus
    L, E, D = draw(st.integers(1, 3)), draw(st.integers(2, 24)), draw(st.integers(1, 4))
    k = draw(st.integers(1, min(4, E)))
    redundant = draw(st.integers(0, min(E * (G - 1), E)))
    seed = draw(st.integers(0, 10_000))
    pi, q = synthetic_domains(L, E, draw(st.sampled_from([0.0, 1.0])), D, seed, draw(st.sampled_from([1.0, 8.0, 50.0])))
    mix = pi[0]
    load = np.round(1e4 * k * np.einsum("d,lde->le", mix, q))
    stats = LoadStats(L, E, k, load, None)
    default_slots = -(-(E + redundant) // G)
    options = PlanOptions(
        redundant,
        draw(st.sampled_from([None, default_slots + 1])),
        balance_tolerance=draw(st.sampled_from([0.0, 0.02, 0.2])),
    )
    return stats, topo, options, _affinity(q, mix)


@SETTINGS
@given(skewed())
def test_affinity_keeps_constraints_and_balance_and_never_touches_more_groups(problem):
    stats, topo, options, affinity = problem
    without = plan(stats, topo, options)
    with_ = plan(stats, topo, options, affinity=affinity)
    with_.placement.check(with_.slots_per_gpu)
    assert np.array_equal(with_.placement.shares, plan(stats, topo, options, affinity=affinity).placement.shares)
    ours = gpu_loads(stats.load, with_.placement.shares).max(axis=1)
    plain = gpu_loads(stats.load, without.placement.shares).max(axis=1)
    eplb = gpu_loads(stats.load, with_.baseline.shares).max(axis=1)
    assert (ours <= plain * (1 + options.balance_tolerance) * (1 + 1e-9) + 1e-6).all(), "within the tolerance"
    assert (ours <= eplb * (1 + 1e-9) + 1e-6).all(), "never less balanced than EPLB, per layer"
    before = groups_per_token(affinity, without.placement.shares, stats.top_k)
    after = groups_per_token(affinity, with_.placement.shares, stats.top_k)
    assert (after <= before + 1e-9).all()


@SETTINGS
@given(skewed())
def test_without_affinity_the_plan_ignores_every_affinity_setting(problem):
    stats, topo, options, _ = problem
    base = plan(stats, topo, options).placement.shares
    other = PlanOptions(
        options.redundant, options.slots_per_gpu, balance_tolerance=options.balance_tolerance, affinity_swaps=0
    )
    assert np.array_equal(plan(stats, topo, other, affinity=None).placement.shares, base)


def test_constructed_case_touches_strictly_fewer_groups():
    # Domain 0 uses experts 0 and 1 only, domain 1 experts 2 and 3; equal loads. Heaviest-first packing
    # alternates GPUs (0, 2 | 1, 3), so every token of either domain reaches both GPUs.
    topo = grid_topology(1, 1, 2)
    stats = LoadStats(1, 4, 2, np.full((1, 4), 100.0), None)
    q = np.array([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]])
    affinity = _affinity(q, np.array([0.5, 0.5]))
    options = PlanOptions(redundant=0)
    without = plan(stats, topo, options).placement
    with_ = plan(stats, topo, options, affinity=affinity).placement
    assert groups_per_token(affinity, without.shares, 2)[0] == pytest.approx(1.5)  # 1 - 0.5**2 on each GPU
    assert groups_per_token(affinity, with_.shares, 2)[0] == pytest.approx(1.0)
    assert {frozenset(np.flatnonzero(with_.shares[0, :, g])) for g in range(2)} == {
        frozenset({0, 1}),
        frozenset({2, 3}),
    }
    assert gpu_loads(stats.load, with_.shares).max() == gpu_loads(stats.load, without.shares).max()


def test_a_free_slot_takes_a_moved_replica():
    # One expert per GPU to start with; domain 0 uses experts 1 and 2, which sit on two GPUs. No exchange
    # helps (exchanging two lone experts changes nothing), but GPU 1 has a free slot and room under the cap.
    topo = grid_topology(1, 1, 3)
    stats = LoadStats(1, 3, 2, np.array([[100.0, 10.0, 10.0]]), None)
    q = np.array([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    affinity = _affinity(q, np.array([0.5, 0.5]))
    options = PlanOptions(redundant=0, slots_per_gpu=2)
    without = plan(stats, topo, options).placement
    with_ = plan(stats, topo, options, affinity=affinity).placement
    with_.check(2)
    assert without.slots_used().max() == 1
    assert sorted(with_.slots_used()[0]) == [0, 1, 2], "one replica moved into a free slot"
    assert np.flatnonzero(with_.shares[0, 1]).tolist() == np.flatnonzero(with_.shares[0, 2]).tolist()
    assert groups_per_token(affinity, with_.shares, 2)[0] < groups_per_token(affinity, without.shares, 2)[0]


def test_tolerance_bounds_what_co_location_may_cost():
    stats, topo = synthetic_stats(4, 32, 4, 1.0, 4, seed=2), grid_topology(1, 1, 8)
    pi, q = synthetic_domains(4, 32, 1.0, 4, 2, 30.0)
    affinity = _affinity(q, pi[0])
    base = gpu_loads(stats.load, plan(stats, topo, PlanOptions(redundant=4)).placement.shares).max(axis=1)
    for tol in (0.0, 0.1, 0.5):
        result = plan(stats, topo, PlanOptions(redundant=4, balance_tolerance=tol), affinity=affinity)
        assert (gpu_loads(stats.load, result.placement.shares).max(axis=1) <= base * (1 + tol) + 1e-6).all()


def test_groups_per_token_formula():
    affinity = _affinity(np.array([[[0.25, 0.25, 0.5]]]), np.array([1.0]))
    together = np.array([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]])
    split = np.array([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    assert groups_per_token(affinity, together, 2)[0] == pytest.approx(1.0)
    assert groups_per_token(affinity, split, 2)[0] == pytest.approx(2 * (1 - 0.5**2))


def test_sampled_groups_count_distinct_gpus():
    shares = np.array([[[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]])
    experts = np.array([[[0, 1], [0, 0], [2, 0]]])
    u = np.array([[[0.1, 0.1], [0.1, 0.9], [0.9, 0.1]]])  # expert 2 with u 0.9 -> GPU 1
    assert sampled_groups_per_token(shares, experts, u) == pytest.approx((2 + 1 + 2) / 3)


def test_affinity_from_counts_normalises_and_drops_silent_domains():
    counts = np.array([[[3.0, 1.0], [0.0, 0.0], [0.0, 4.0]], [[2.0, 2.0], [1.0, 0.0], [1.0, 3.0]]])
    affinity = affinity_from_counts(("a", "b", "c"), counts)
    assert affinity.domains == ("a", "c")
    assert np.allclose(affinity.share[0], [[0.75, 0.25], [0.0, 1.0]])
    assert np.allclose(affinity.weight, [8 / 16, 8 / 16])
    with pytest.raises(InputError, match="no domain has tokens"):
        affinity_from_counts(("a",), np.zeros((1, 1, 2)))


def test_affinity_json_round_trip_and_errors():
    affinity = _affinity(np.array([[[0.5, 0.5], [1.0, 0.0]]]), np.array([0.3, 0.7]))
    again = parse_affinity_json(json.dumps(affinity_to_dict(affinity)))
    assert again.domains == affinity.domains and np.array_equal(again.share, affinity.share)
    bad = [
        ("{", "not valid JSON"),
        ("[]", "JSON object with domains"),
        ('{"domains": ["a"], "weight": [1], "share": [[[0.5, 0.2]]]}', "sum to 1"),
        ('{"domains": ["a"], "weight": [0.5], "share": [[[0.5, 0.5]]]}', "weights must sum to 1"),
        ('{"domains": ["a"], "weight": [1], "share": [[[-0.5, 1.5]]]}', "non-negative"),
        ('{"domains": ["a", "b"], "weight": [1], "share": [[[0.5, 0.5]]]}', "share must be"),
        ('{"domains": [""], "weight": [1], "share": [[[0.5, 0.5]]]}', "non-empty strings"),
        ('{"domains": ["a"], "weight": [1], "share": [[[0.5], [0.5, 0.5]]]}', "rectangular"),
    ]
    for text, message in bad:
        with pytest.raises(InputError, match=message):
            parse_affinity_json(text)


def test_affinity_must_match_the_stats():
    stats = synthetic_stats(2, 8, 2, 1.0, 2, seed=1)
    affinity = _affinity(np.full((2, 1, 6), 1 / 6), np.array([1.0]))
    with pytest.raises(InputError, match="affinity covers 2 layers x 6 experts, the stats 2 x 8"):
        plan(stats, grid_topology(1, 1, 2), PlanOptions(redundant=0), affinity=affinity)


def test_bench_domain_case_reports_both_sides():
    (case,) = affinity_cases(quick=True)
    result = run_affinity_case(case, seed=0)
    assert result.with_affinity.groups_per_token < result.without.groups_per_token
    assert result.with_affinity.balancedness >= result.without.balancedness / (1 + case.balance_tolerance) - 1e-9


# --- `expertmesh plan --profiles / --state-url` --------------------------------------------------

TOPO = """
nodes:
  - name: node-0
    islands:
      - {name: nvl-0, numa: 0, gpus: [{id: 0, memory_gb: 80}, {id: 1, memory_gb: 80}]}
      - {name: nvl-1, numa: 1, gpus: [{id: 2, memory_gb: 80}, {id: 3, memory_gb: 80}]}
"""


def _profiles(num_layers: int, num_experts: int, seed: int):
    from expertmesh.router.policy.profiles import build_profiles

    _, q = synthetic_domains(num_layers, num_experts, 1.0, 3, seed, 30.0)
    return build_profiles({f"dom{d}": 1000 * q[:, d] for d in range(3)}, tuple(range(1, num_layers + 1)))


@pytest.fixture
def plan_files(tmp_path):
    from expertmesh.orchestrator.placement.stats import stats_to_dict

    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(stats_to_dict(synthetic_stats(3, 16, 2, 1.0, 3, seed=5))))
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPO)
    return tmp_path, [
        "plan",
        "--stats",
        str(stats),
        "--topology",
        str(topo),
        "--redundant",
        "4",
        "--balance-tolerance",
        "0.1",
    ]


def test_plan_reads_profiles_file(plan_files, capsys):
    from expertmesh.cli.main import main

    tmp_path, argv = plan_files
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps([json.loads(p.to_json()) for p in _profiles(3, 16, 1).values()]))
    assert main([*argv, "--profiles", str(profiles), "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "domain affinity from 3 profiles (dom0, dom1, dom2)" in out
    planner, eplb = re.search(r"per token ([0-9.]+) \(eplb ([0-9.]+)\)", out).groups()
    assert float(planner) < float(eplb)
    assert (tmp_path / "p.json").is_file()


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "not JSON"),
        ('[{"domain": "a"}]', "profile 'a': missing moe_layers"),
        ("[]", "expected a non-empty JSON list of profile records"),
    ],
)
def test_plan_bad_profiles_file_is_one_line(plan_files, capsys, content, message):
    from expertmesh.cli.main import main

    tmp_path, argv = plan_files
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main([*argv, "--profiles", str(bad), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_plan_profiles_of_another_model_are_refused(plan_files, capsys):
    from expertmesh.cli.main import main

    tmp_path, argv = plan_files
    other = tmp_path / "other.json"
    other.write_text(json.dumps([json.loads(p.to_json()) for p in _profiles(2, 16, 1).values()]))
    assert main([*argv, "--profiles", str(other), "--out", str(tmp_path / "p.json")]) == 2
    assert "affinity covers 2 layers x 16 experts, the stats 3 x 16" in capsys.readouterr().err


def test_plan_reads_profiles_from_the_state_store(plan_files, redis_url, capsys):
    from expertmesh.cli.main import main
    from expertmesh.router.policy.profiles import save_profiles
    from expertmesh.store import open_store

    tmp_path, argv = plan_files
    store = open_store(redis_url)
    try:
        save_profiles(store, _profiles(3, 16, 1))
    finally:
        store.close()
    assert main([*argv, "--state-url", redis_url, "--out", str(tmp_path / "p.json")]) == 0
    assert "domain affinity from 3 profiles" in capsys.readouterr().out
