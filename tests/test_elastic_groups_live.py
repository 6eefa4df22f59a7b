"""Expert groups added and removed live, end to end on the embedded platform, through a short
``expertmesh bench elastic`` run (``bench.elastic.run``): ``expertmesh up --orchestrator
--groups-as process`` (real ``group serve`` processes, no Ray; and ``--groups-as in-process``, the groups in the
platform's own process) serving looping streaming greedy
clients while AddGroup starts an empty group that the planner fills by live moves, a load step
up, RemoveGroup of g0 (drained by make-before-break moves, its process stopped), and the step down.

Every answer is compared token by token with stock transformers; no request may fail. Timings (add
-> the first token the new group computes, remove -> its process stopped) and ITL ratios are
printed and recorded as test properties, never asserted.
"""

from __future__ import annotations

import pytest

from expertmesh.bench.elastic import Options, run, table

pytestmark = pytest.mark.slow
CLIENTS, STEP = 3, 2


def short_run(model, clients: int = CLIENTS, step: int = STEP, **changes) -> Options:
    """A short ``bench elastic`` run of the tiny model for tests: a few clients, 1 s phases."""
    return Options(
        model=model,
        groups=2,
        clients=clients,
        step_clients=step,
        prompt_tokens=6,
        max_new_tokens=8,
        phase_seconds=1.0,
        heartbeat_s=0.2,
        timeout_s=300.0,
        **changes,
    )


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return tiny_checkpoints("mixtral", num_local_experts=8)


@pytest.mark.parametrize("groups_as", ["process", "in-process"])
def test_groups_added_and_removed_under_streaming_load_fail_nothing_and_change_no_token(
    model, tmp_path, monkeypatch, record_property, groups_as
):
    """Also with the groups in the platform's own process (``up --groups-as in-process``): the new group starts
    there, is called in place once filled, and the removed one's server closes (its process is the router's)."""
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path / "home"))
    result = run(short_run(model, groups_as=groups_as))
    print("\n" + table(result))

    (cycle,) = result["cycles"]
    before, after, add, remove = result["groups_before"], result["groups_after"], cycle["add"], cycle["remove"]
    assert {n: g["phase"] for n, g in before.items()} == {"g0": "serving", "g1": "serving"}
    assert [p["phase"] for p in cycle["phases"]] == [
        "baseline",
        "add g2",
        "after add",
        "step up",
        "remove g0",
        "step down",
    ]
    high = CLIENTS + STEP
    assert [p["clients"] for p in cycle["phases"]] == [CLIENTS, CLIENTS, CLIENTS, high, high, CLIENTS]
    # no request failed, every answer is stock transformers' (in every phase, and in all)
    assert result["requests"]["failed"] == 0, result["requests"].get("first_failure")
    assert result["requests"]["differing_from_stock"] == 0
    assert all(p["failed"] == 0 and p["differing"] == 0 for p in cycle["phases"])
    # every phase has answers and tokens to measure; a change's ITL is compared with the phase before it
    assert all(p["requests"] >= p["clients"] and p["tokens"] > 0 for p in cycle["phases"])
    ratios = result["p99_during_change_over_before"]
    assert set(ratios) == {"add", "remove"} and all(len(v) == 1 and v[0] > 0 for v in ratios.values())
    assert result["p99_median"] == {kind: v[0] for kind, v in ratios.items()}

    # -- add: a new empty group process, filled by live moves, served tokens
    assert add["group"] == "g2" and add["phase"] == "serving", add["reason"]
    assert add["experts"] > 0 and add["moves"] == add["moves_planned"] > 0 and add["bytes_moved"] > 0
    assert add["experts_held"] == add["experts"], "the group holds what the routing table lists it for"
    assert 0 < add["to_first_token_s"] and 0 < add["to_listed_s"] <= add["to_serving_s"]

    # -- remove: g0 drained by make-before-break moves, then its process stopped
    assert remove["group"] == "g0" and remove["phase"] == "stopped", remove["reason"]
    assert remove["experts"] == 0 and remove["exit_code"] == 0 and remove["group_ended"]
    assert remove["moves"] == remove["moves_planned"] > 0
    assert 0 < remove["to_drained_s"] <= remove["to_stopped_s"] and remove["stop_after_drain_s"] >= 0

    # nothing else restarts: g1 is the process it was; g1 and g2 serve every (layer, expert) pair once
    assert after["g1"]["pid"] == before["g1"]["pid"]
    if groups_as == "in-process":  # every group is the platform's process
        assert after["g1"]["pid"] == after["g2"]["pid"] == before["g0"]["pid"]
    else:
        assert len({before["g0"]["pid"], after["g1"]["pid"], after["g2"]["pid"]}) == 3
    assert sorted(n for n, g in after.items() if g["phase"] == "serving") == ["g1", "g2"]
    assert sum(g["experts"] for g in after.values()) == 2 * 8
    assert result["platform_served_on"] and result["platform_exit_code"] == 0

    figures = {
        "add_to_first_token_s": add["to_first_token_s"],
        "add_to_serving_s": add["to_serving_s"],
        "remove_to_stopped_s": remove["to_stopped_s"],
        "remove_moves": remove["moves"],
        "requests": result["requests"]["completed"],
        **{f"itl_p99_ratio_{k}": v for k, v in result["p99_median"].items()},
    }
    for key, value in figures.items():
        record_property(key, value)
