"""The scale simulation (``expertmesh bench scale``): its pure parts, the simulated store, groups and
routers, and one quick run's structure and invariants. Nothing here asserts on wall-clock time."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from expertmesh.bench.scale.model import DEEPSEEK_V3, QUICK_MODEL, Costs, diurnal, zipf_popularity
from expertmesh.bench.scale.run import Case, run_case
from expertmesh.bench.scale.simulated import Clock, CountingBackend, RouterFleet, SimulatedGroups
from expertmesh.bench.scale.suite import plots, table
from expertmesh.cli.main import main
from expertmesh.orchestrator.capacity.config import CapacityConfig
from expertmesh.orchestrator.migration.group_calls import GroupCallFailed
from expertmesh.store import StateStore

QUICK_COSTS = Costs(budget_bytes=64 * QUICK_MODEL.expert_bytes)


def test_deepseek_v3_shape():
    assert DEEPSEEK_V3.pairs == 58 * 256
    assert DEEPSEEK_V3.expert_bytes == 3 * 7168 * 2048 * 2  # 88 MB in bf16
    assert Costs().load_s(DEEPSEEK_V3.expert_bytes) == pytest.approx(DEEPSEEK_V3.expert_bytes / 2e9 + 0.002)


def test_diurnal_peaks_in_the_afternoon():
    assert diurnal(14.0) == pytest.approx(1.0)
    assert diurnal(2.0) == pytest.approx(0.1)


def test_zipf_popularity_is_a_distribution_that_drifts_smoothly():
    a = zipf_popularity(3, 32, 0.0, seed=1)
    assert a.shape == (3, 32)
    np.testing.assert_allclose(a.sum(axis=1), 1.0)
    np.testing.assert_array_equal(a, zipf_popularity(3, 32, 0.0, seed=1))  # deterministic
    # Zipf: the hottest expert takes 1/H(32) of a layer's tokens.
    np.testing.assert_allclose(a.max(axis=1), 1.0 / np.sum(1.0 / np.arange(1, 33)))
    later = zipf_popularity(3, 32, 12.0, seed=1)
    # between epochs the shares move linearly: a minute later is close, half a day later is not
    assert np.abs(zipf_popularity(3, 32, 1.0, seed=1) - zipf_popularity(3, 32, 1.0 + 1 / 60, seed=1)).max() < 0.01
    assert np.abs(a - later).max() > 0.01


def test_counting_backend_counts_per_caller_and_kind():
    backend = CountingBackend()
    routers, orch = StateStore(backend.view("routers")), StateStore(backend.view("orchestrator"))
    orch.set_endpoint("g0", "sim://g0")
    routers.routing_table_version()
    routers.publish_load("r0", b"12345")
    assert dict(backend.counts["routers"].ops) == {"get": 1, "hset": 1}
    assert backend.counts["routers"].bytes_in == 5
    assert dict(backend.counts["orchestrator"].ops) == {"hset": 1}
    assert routers.endpoints() == {"g0": "sim://g0"}  # one store under the views
    backend.reset()
    assert backend.counts["routers"].total() == 0


def test_simulated_groups_load_unload_and_budget():
    clock = Clock()
    groups = SimulatedGroups(QUICK_MODEL, Costs(budget_bytes=2 * QUICK_MODEL.expert_bytes), {"g0": {(0, 0)}}, clock)
    assert groups.describe("g0").weight_bytes == QUICK_MODEL.expert_bytes
    assert groups.load("g0", (0, 1)).added
    assert not groups.load("g0", (0, 1)).added
    with pytest.raises(GroupCallFailed) as err:
        groups.load("g0", (0, 2))
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert groups.peak_memory == pytest.approx(1.0)
    assert groups.unload("g0", (0, 0)) and not groups.describe("g0").holds((0, 0))
    groups.set_busy({"g0": 0.5})
    clock.advance_to(10.0)
    assert groups.describe("g0").busy_seconds == pytest.approx(5.0)


def _window_ops(routers: int) -> dict:
    backend = CountingBackend()
    fleet = RouterFleet(StateStore(backend.view("routers")), routers, Costs(), pulse_bytes=b"x" * 100)
    fleet.run_window(0.0, 20.0)
    return dict(backend.counts["routers"].ops)


def test_router_store_ops_grow_linearly_in_routers():
    one, two = _window_ops(8), _window_ops(16)
    assert two == {kind: 2 * n for kind, n in one.items()}
    # per router and second: 4 version GETs + 4 quarantine HGETALLs, a heartbeat, a tenth of a load window
    assert one == {"get": 8 * 80, "hgetall": 8 * 80, "hset": 8 * 20 + 8 * 2}


def _load_bytes_in_s(routers: int, budget_bytes_s: float) -> float:
    """The fleet's load-window bytes a second into the store (heartbeats taken out) over 600 simulated s."""
    backend = CountingBackend()
    fleet = RouterFleet(
        StateStore(backend.view("routers")), routers, Costs(), pulse_bytes=b"p" * 1000, budget_bytes_s=budget_bytes_s
    )
    fleet.run_window(0.0, 600.0)
    beats = backend.counts["routers"].ops["hset"] - fleet.count * 600 / fleet.load_publish_s
    heartbeat_bytes = backend.counts["routers"].bytes_in - 1000 * fleet.count * 600 / fleet.load_publish_s
    assert beats == pytest.approx(routers * 600, rel=0.01) and heartbeat_bytes > 0
    return (backend.counts["routers"].bytes_in - heartbeat_bytes) / 600


def test_the_fleets_load_inflow_stops_growing_at_its_budget():
    """Every router 1 KB every 10 s: 100 B/s each; a budget of 2 KB/s binds from 20 routers on."""
    assert _load_bytes_in_s(10, 2000.0) == pytest.approx(1000.0)
    assert _load_bytes_in_s(40, 2000.0) == pytest.approx(2000.0, rel=0.05)
    assert _load_bytes_in_s(160, 2000.0) == pytest.approx(2000.0, rel=0.05)
    assert _load_bytes_in_s(160, 0.0) == pytest.approx(16_000.0)  # no budget: linear


def _cycle(detail_bytes: bytes) -> tuple[CountingBackend, StateStore, RouterFleet]:
    backend = CountingBackend()
    store = StateStore(backend.view("routers"))
    fleet = RouterFleet(store, 7, Costs(), pulse_bytes=b"p" * 10, detail_bytes=detail_bytes, detail_every=6)
    fleet.run_window(0.0, 60.0)  # one cycle of details: 6 pulses 10 s apart a router
    return backend, store, fleet


def test_fleet_writes_each_routers_detail_once_a_cycle():
    plain, _, _ = _cycle(b"")
    backend, store, fleet = _cycle(b"d" * 1000)
    assert backend.counts["routers"].ops["hset"] - plain.counts["routers"].ops["hset"] == 7
    assert backend.counts["routers"].bytes_in - plain.counts["routers"].bytes_in == 7 * 1000
    assert set(store.load_details()) == set(store.loads()) == set(fleet.ids)


def test_quick_run_reports_store_bytes_before_and_after(quick_runs):
    store = quick_runs[4]["store"]
    assert store["load_pulse_bytes"] < store["load_detail_bytes"] < store["load_window_bytes"]
    assert store["router_bytes_in_s"] < store["router_bytes_in_s_before"]
    assert store["scan_reads_bytes"] == 4 * store["load_pulse_bytes"]
    assert store["scan_reads_bytes_before"] == 4 * store["load_window_bytes"]
    assert {"scan_decode_wall_s", "scan_decode_wall_s_before", "detail_decode_wall_s"} <= set(store)
    assert "was (whole windows)" in table([quick_runs[4]])


def test_serve_delays_are_within_one_poll():
    fleet = RouterFleet(StateStore(CountingBackend().view("routers")), 16, Costs())
    delays = fleet.serve_delays(3.1, table_bytes=1000)
    overhead = 2 * Costs().fetch_s(0) + Costs().fetch_s(1000) + Costs().step_s
    assert delays.shape == (16,)
    assert (delays >= overhead).all() and (delays < 0.25 + overhead).all()


@pytest.fixture(scope="module")
def quick_runs():
    return {r: run_case(Case(QUICK_MODEL, gpus=4, routers=r, hours=2.0, costs=QUICK_COSTS)) for r in (2, 4)}


def test_quick_run_structure_and_invariants(quick_runs):
    result = quick_runs[2]
    assert set(result) >= {"case", "planner", "drift", "memory", "table", "store", "health", "hours"}
    assert [h["hour"] for h in result["hours"]] == [1.0, 2.0]
    for h in result["hours"]:
        assert 0 < h["balancedness_static"] <= 1 and 0 < h["balancedness_drift"] <= 1
    assert result["table"]["unhosted_or_unheld"] == 0
    assert result["table"]["versions_strictly_increase"]
    assert result["drift"]["succeeded"] >= 1  # the drifting load made drift move something
    assert result["drift"]["bytes_moved_per_hour"] == pytest.approx(
        result["drift"]["moves_per_hour"] * QUICK_MODEL.expert_bytes
    )
    assert 0 < result["memory"]["peak_utilisation"] <= 1
    assert result["health"]["replicas"] == QUICK_MODEL.moe_layers * (
        QUICK_MODEL.num_experts + 4
    )  # moves keep the count
    assert result["health"]["probe_bytes"] == 2 * result["health"]["replicas"] * 1000 * QUICK_MODEL.hidden_size * 2


def test_quick_run_reports_the_full_and_the_incremental_planner(quick_runs):
    planner = quick_runs[2]["planner"]
    assert planner["replan_wall_s"] == planner["day_end"]["full"]["wall_s"]
    for change in ("day_end", "gpu_added", "gpu_removed"):
        for which in ("full", "incremental"):
            figures = planner[change][which]
            assert 0 < figures["balancedness"] <= 1 and 0 <= figures["cross_island"] <= 1
            assert figures["weights_moved"] >= 0 and figures["wall_s"] >= 0 and figures["cpu_s"] >= 0
        assert "layers_replanned" in planner[change]["incremental"]
    # one GPU per redundant replica: 4 GPUs -> 5 and 3, each layer E + GPUs replicas at most
    assert planner["gpu_added"]["incremental"]["replicas"] <= QUICK_MODEL.moe_layers * (QUICK_MODEL.num_experts + 5)
    assert planner["gpu_removed"]["incremental"]["replicas"] <= QUICK_MODEL.moe_layers * (QUICK_MODEL.num_experts + 3)
    text = table([quick_runs[2]])
    assert "+1 GPU s full/inc" in text and "-1 GPU moved" in text


def test_quick_run_reports_a_sampled_health_round(quick_runs):
    health = quick_runs[2]["health"]
    sampled = health["sampled"]
    # the quick model's 80 replicas x 1000 tokens fit the default budget: one round covers them all
    assert sampled["replicas"] == health["replicas"] and sampled["rounds_to_cover"] == 1
    small = run_case(Case(QUICK_MODEL, gpus=4, routers=2, hours=0.1, costs=QUICK_COSTS, sampled_round_rows=20 * 1000))[
        "health"
    ]["sampled"]
    # 20 replicas a round, whole layers of 20 (16 experts + 4 redundant): one layer a round, four to cover
    assert small["replicas"] == 20 and small["rounds_to_cover"] == QUICK_MODEL.moe_layers
    assert small["probe_bytes"] * QUICK_MODEL.moe_layers == health["probe_bytes"]
    assert small["hours_to_cover"] == pytest.approx(QUICK_MODEL.moe_layers * 600 / 3600)
    assert "rounds to cover (h)" in table([quick_runs[2]])


def test_quick_run_store_ops_linear_in_routers(quick_runs):
    two, four = quick_runs[2]["store"], quick_runs[4]["store"]
    assert four["router_ops_s"] == pytest.approx(2 * two["router_ops_s"], rel=0.01)
    assert four["ops_s_per_router"] == pytest.approx(two["ops_s_per_router"], rel=0.01)


def test_bench_scale_command_writes_json(tmp_path):
    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--quick", "--gpus", "4", "--routers", "2", "--hours", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "scale" and len(doc["results"]) == 1
    assert doc["results"][0]["case"] == {
        "model": "quick",
        "gpus": 4,
        "routers": 2,
        "hours": 1.0,
        "redundant": 4,
        "min_gain": 0.01,
        "capacity": False,
    }


def test_bench_scale_merges_runs_made_separately_into_one_table_and_json(tmp_path, capsys):
    """A day of each case is long, so the cases run as separate commands; --merge reports them together."""
    runs = []
    for routers in ("2", "4"):
        runs.append(tmp_path / f"r{routers}.json")
        argv = ["--quick", "--gpus", "4", "--routers", routers, "--hours", "1", "--out", str(runs[-1])]
        assert main(["bench", "scale", *argv]) == 0
        assert json.loads(runs[-1].read_text())["complete"] is True
    capsys.readouterr()
    out = tmp_path / "merged.json"
    assert main(["bench", "scale", "--merge", *map(str, runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 GPUs 2 routers" in printed and "4 GPUs 4 routers" in printed
    doc = json.loads(out.read_text())
    separate = [json.loads(r.read_text())["results"][0] for r in runs]
    assert doc["results"] == separate and [m["path"] for m in doc["merged_from"]] == list(map(str, runs))
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "serve", "results": []}))
    for bad in (["--merge", str(tmp_path / "other.json")], ["--merge", str(tmp_path / "none.json")]):
        assert main(["bench", "scale", *bad, "--out", str(out)]) == 2
    assert main(["bench", "scale", "--merge", str(runs[0]), "--out", str(runs[0])]) == 2
    assert main(["bench", "scale", "--merge", str(runs[0]), "--gpus", "4", "--out", str(out)]) == 2
    assert "is not the JSON of a bench scale run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--hours", "0"], ["--gpus", "x"], ["--routers", "0"], ["--gpus", "12"], ["--gpus", "8"], ["--min-gain", "2"]],
    ids=["hours", "gpus-not-int", "routers-zero", "gpus-not-nodes", "gpus-too-few-for-dsv3", "min-gain"],
)
def test_bench_scale_bad_flags_exit_2(argv):
    assert main(["bench", "scale", *argv]) == 2


def test_table_and_plots_of_a_quick_run(quick_runs, tmp_path):
    text = table(list(quick_runs.values()))
    assert "4 GPUs 2 routers" in text and "4 GPUs 4 routers" in text
    pytest.importorskip("matplotlib")
    message = plots(list(quick_runs.values()), tmp_path / "plots")
    assert (tmp_path / "plots" / "balancedness.png").stat().st_size > 0
    assert (tmp_path / "plots" / "moves.png").stat().st_size > 0
    assert "wrote" in message


def test_the_capacity_controller_holds_balancedness_above_drift_alone_over_a_drifting_day(quick_runs):
    """The same simulated day with the capacity controller beside drift: its replicas and retires are real
    migrations (make-before-break: nothing unhosted), and the hourly balancedness stays above drift alone's and
    the first placement's (the controller's whole point; the simulated figures, not a wall-clock time)."""
    alone = quick_runs[2]
    both = run_case(Case(QUICK_MODEL, gpus=4, routers=2, hours=2.0, costs=QUICK_COSTS, capacity=CapacityConfig()))
    assert both["case"]["capacity"] and not alone["case"]["capacity"]
    assert both["drift"]["capacity_decisions"].get("replicate", 0) >= 1
    assert both["table"]["unhosted_or_unheld"] == 0 and both["table"]["versions_strictly_increase"]
    assert 0 < both["memory"]["peak_utilisation"] <= 1  # replicas stayed within the groups' budgets
    for mine, theirs in zip(both["hours"], alone["hours"]):
        assert mine["balancedness_drift"] > theirs["balancedness_drift"]
        assert mine["balancedness_drift"] > mine["balancedness_static"]
