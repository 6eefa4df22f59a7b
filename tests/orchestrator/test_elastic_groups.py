"""Expert groups added and removed live (``orchestrator.elastic``): the plan and the lifecycle checks as
pure functions, then the controller over real group servers on loopback (``migration_mesh``, no Ray, no
processes: a launcher stand-in hands it the empty ``g2``) with every move a real make-before-break
migration."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from migration_mesh import FAST, start_mesh

from expertmesh.contracts.errors import GroupChangeRefused, GroupNotFound, InvalidRequest
from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.admin import MigrationRunner
from expertmesh.orchestrator.drift.state import ExpertLoad
from expertmesh.orchestrator.elastic.controller import GroupController, GroupRequest
from expertmesh.orchestrator.elastic.plan import Step, fits, plan_change, size, steps_for
from expertmesh.orchestrator.elastic.state import (
    GroupPhase,
    GroupRecord,
    checked_add,
    checked_remove,
    next_group_name,
)
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from expertmesh.orchestrator.migration.state import MigrationMode, load_all
from expertmesh.store import open_store
from helpers import wait_for

MOVE, REPLICATE, EVICT = MigrationMode.MOVE, MigrationMode.REPLICATE, MigrationMode.EVICT


def _table(groups: dict[str, list[tuple[int, int]]], experts: int = 8, version: int = 1) -> RoutingTable:
    return RoutingTable.from_placement(GroupPlacement({g: tuple(p) for g, p in groups.items()}), experts, version)


def _two_groups(layers: int = 4, experts: int = 8) -> RoutingTable:
    half = experts // 2
    return _table(
        {
            "g0": [(layer, e) for layer in range(layers) for e in range(half)],
            "g1": [(layer, e) for layer in range(layers) for e in range(half, experts)],
        },
        experts,
    )


def _apply(table: RoutingTable, plan) -> RoutingTable:
    """The table after every step of ``plan``, each checked against the replicas it starts from."""
    replicas = dict(table.replicas)
    for steps in plan.steps:
        for step in steps:
            pair = (step.layer, step.expert)
            now = replicas[pair]
            assert step.source in now, (step, now)
            if step.mode is MOVE:
                assert step.target not in now
                replicas[pair] = tuple(step.target if g == step.source else g for g in now)
            elif step.mode is REPLICATE:
                replicas[pair] = (*now, step.target)
            else:
                assert len(now) > 1, "an evict never takes a pair's last replica"
                replicas[pair] = tuple(g for g in now if g != step.source)
    return dataclasses.replace(table, replicas=replicas, shares={}, version=table.version + 1)


# -- steps ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        (("g0",), ("g0",), ()),
        (("g0",), ("g2",), ((MOVE, "g0", "g2"),)),
        (("g0",), ("g0", "g2"), ((REPLICATE, "g0", "g2"),)),
        (("g0", "g1"), ("g1",), ((EVICT, "g0", None),)),
        (("g0", "g1"), ("g2", "g3", "g1"), ((MOVE, "g0", "g2"), (REPLICATE, "g1", "g3"))),
        (("g0", "g1"), ("g2",), ((MOVE, "g0", "g2"), (EVICT, "g1", None))),
        (("g0",), ("g2", "g3"), ((MOVE, "g0", "g2"), (REPLICATE, "g2", "g3"))),
    ],
)
def test_steps_never_leave_a_pair_unserved(before, after, expected):
    steps = steps_for((3, 5), before, after)
    assert [(s.mode, s.source, s.target) for s in steps] == list(expected)
    assert all((s.layer, s.expert) == (3, 5) for s in steps)


# -- plans ----------------------------------------------------------------------------------


@pytest.mark.parametrize("loaded", [False, True])
def test_an_added_group_is_filled_and_every_expert_stays_served(loaded):
    table = _two_groups()
    loads = [ExpertLoad(layer, e, float((e + 1) ** 2)) for layer in range(4) for e in range(8)] if loaded else []
    plan = plan_change(table, loads, ("g0", "g1", "g2"), top_k=2, expert_bytes=1000)
    after = _apply(table, plan)
    assert set(after.replicas) == set(table.replicas)
    held = after.placement().groups
    assert sorted(held) == ["g0", "g1", "g2"]
    per_layer = {layer: sum(1 for (lay, _) in held["g2"] if lay == layer) for layer in range(4)}
    assert all(count >= 2 for count in per_layer.values()), per_layer  # ceil(8 / 3) slots: each layer gives it some
    assert plan.bytes_moved == plan.copies * 1000 and plan.copies >= len(held["g2"])
    assert {p: tuple(sorted(g)) for p, g in after.replicas.items()} == {
        p: tuple(sorted(g)) for p, g in plan.after.items()
    }


def test_an_idle_add_moves_only_what_the_new_group_gets():
    table = _two_groups()
    plan = plan_change(table, [], ("g0", "g1", "g2"), top_k=2, expert_bytes=1)
    assert all(step.mode is MOVE and step.target == "g2" for steps in plan.steps for step in steps)
    assert plan.moves == plan.copies == 8  # two per layer, one from each group


def test_a_removed_group_is_drained_onto_the_others():
    table = _apply(_two_groups(), plan_change(_two_groups(), [], ("g0", "g1", "g2"), 2, 1))
    plan = plan_change(table, [], ("g1", "g2"), top_k=2, expert_bytes=1)
    after = _apply(table, plan)
    assert "g0" not in after.groups() and set(after.replicas) == set(table.replicas)
    assert all(step.target != "g0" for steps in plan.steps for step in steps)
    assert plan.moves == len(table.placement().groups["g0"])  # only its experts move


def test_a_replica_elsewhere_makes_the_drain_an_evict():
    table = _table({"g0": [(0, 0), (0, 1)], "g1": [(0, 0), (0, 2), (0, 3)]}, experts=4)
    plan = plan_change(table, [], ("g1",), top_k=1, expert_bytes=1)
    by_pair = {(s.layer, s.expert): (s.mode, s.source) for steps in plan.steps for s in steps}
    assert by_pair == {(0, 0): (EVICT, "g0"), (0, 1): (MOVE, "g0")}
    assert plan.copies == 1


def test_no_group_left_is_refused():
    with pytest.raises(GroupChangeRefused, match="no expert group would be left"):
        plan_change(_two_groups(), [], (), top_k=2, expert_bytes=1)


def test_fits_counts_what_each_group_gains_against_its_free_budget():
    plan = plan_change(_two_groups(), [], ("g0", "g1", "g2"), top_k=2, expert_bytes=1 << 20)
    assert fits(plan, {"g0": None, "g1": None, "g2": None}, 1 << 20) is None  # no budget: unlimited
    assert fits(plan, {"g2": 8 << 20}, 1 << 20) is None
    assert [size(n) for n in (0, 1023, 1536, 3 << 20, 5 << 30)] == ["0 B", "1023 B", "1.5 KiB", "3.0 MiB", "5.0 GiB"]
    why = fits(plan, {"g2": 3 << 20}, 1 << 20)
    assert why == "group g2 would need 8.0 MiB more for expert weights and has 3.0 MiB free in its budget"
    drain = [(Step(0, 0, MOVE, "g0", "g1"),), (Step(0, 1, MOVE, "g0", "g1"),)]
    assert "group g1 would need 2.0 MiB" in fits(
        dataclasses.replace(plan, steps=tuple(drain)), {"g1": 1 << 20}, 1 << 20
    )


# -- lifecycle checks -------------------------------------------------------------------------


def _records(**phases: GroupPhase) -> dict[str, GroupRecord]:
    return {name: GroupRecord(name, phase) for name, phase in phases.items()}


def test_next_group_name():
    assert next_group_name([]) == "g0"
    assert next_group_name(["g0", "g1", "extra", "g7"]) == "g8"


def test_add_checks():
    serving = _records(g0=GroupPhase.SERVING, g1=GroupPhase.SERVING)
    assert checked_add(None, serving, ["g0", "g1"]) == "g2"
    assert checked_add("big-1", serving, ["g0", "g1"]) == "big-1"
    assert checked_add("g0", _records(g0=GroupPhase.STOPPED, g1=GroupPhase.SERVING), ["g1"]) == "g0"  # reused
    with pytest.raises(InvalidRequest, match="group 'g1' exists already; pick another name or leave it out"):
        checked_add("g1", serving, ["g0", "g1"])
    with pytest.raises(InvalidRequest, match="group name 'G!' is not valid"):
        checked_add("G!", serving, [])
    busy = _records(g0=GroupPhase.SERVING, g1=GroupPhase.DRAINING)
    with pytest.raises(GroupChangeRefused, match="group g1 is draining .* one group change at a time"):
        checked_add(None, busy, [])


def test_remove_checks():
    table = _two_groups()
    serving = _records(g0=GroupPhase.SERVING, g1=GroupPhase.SERVING)
    assert checked_remove("g0", serving, table).name == "g0"
    assert checked_remove(
        "g0", {**serving, "g1": GroupRecord("g1", GroupPhase.FAILED)} | _records(g2=GroupPhase.SERVING), table
    )
    with pytest.raises(GroupNotFound, match="no running expert group 'g9'; the groups: g0, g1"):
        checked_remove("g9", serving, table)
    with pytest.raises(GroupNotFound):
        checked_remove("g0", _records(g0=GroupPhase.STOPPED, g1=GroupPhase.SERVING), table)
    with pytest.raises(GroupChangeRefused, match="'g0' is the last expert group"):
        checked_remove("g0", _records(g0=GroupPhase.SERVING, g1=GroupPhase.STOPPED), table)
    with pytest.raises(GroupChangeRefused, match="one group change at a time"):
        checked_remove("g0", _records(g0=GroupPhase.SERVING, g1=GroupPhase.FILLING), table)
    with pytest.raises(GroupChangeRefused, match="no routing table"):
        checked_remove("g0", serving, None)


def test_lifecycle_transitions():
    record = GroupRecord("g2", GroupPhase.STARTING)
    for phase in (GroupPhase.FILLING, GroupPhase.SERVING, GroupPhase.DRAINING, GroupPhase.STOPPED):
        record = record.entering(phase)
    with pytest.raises(ValueError, match="no transition from stopped to serving"):
        record.entering(GroupPhase.SERVING)
    assert GroupRecord("g", GroupPhase.FAILED).entering(GroupPhase.DRAINING).phase is GroupPhase.DRAINING
    assert [p for p in GroupPhase if p.in_flight] == [GroupPhase.STARTING, GroupPhase.FILLING, GroupPhase.DRAINING]


def test_a_record_reads_back_as_it_was_written_and_a_foreign_one_is_refused():
    record = GroupRecord("g3", GroupPhase.DRAINING, address="10.0.0.1:5", pid=7, moves_done=2, bytes_moved=9)
    assert GroupRecord.from_json(record.to_json().encode()) == record
    with pytest.raises(ValueError, match="not a group record"):
        GroupRecord.from_json('{"name": "g3", "phase": "draining", "color": "red"}')
    with pytest.raises(ValueError):
        GroupRecord.from_json('{"name": "g3", "phase": "sleeping"}')


# -- the controller over real groups ----------------------------------------------------------


class Launcher:
    """Hands out the mesh's empty g2 as the started group; records stops."""

    def __init__(self, mesh, refuse: str | None = None):
        self.mesh = mesh
        self.running_groups = {n: (g.address, 0) for n, g in mesh.groups.items() if n != "g2"}
        self.stopped: list[str] = []
        self.refuse = refuse

    def running(self):
        return dict(self.running_groups)

    def check(self, gpus, island, node):
        if self.refuse:
            raise GroupChangeRefused(self.refuse)

    def check_stop(self, name):
        pass

    def start(self, name, gpus, island, node):
        self.running_groups[name] = (self.mesh.groups["g2"].address, 4242)
        return self.running_groups[name]

    def stop(self, name):
        self.stopped.append(name)
        self.running_groups.pop(name)
        return 0


@pytest.fixture
def mesh(tiny_checkpoints):
    mesh = start_mesh(open_store("memory://"), tiny_checkpoints("mixtral"))
    mesh.store.remove_endpoint("g2")  # not started yet: the launcher starts it
    yield mesh
    for group in mesh.groups.values():
        group.server.stop(0)


@pytest.fixture
def controller(mesh):
    runner = MigrationRunner(mesh.store, MigrationExecutor(mesh.store, **FAST))
    launcher = Launcher(mesh)
    controller = GroupController(mesh.store, runner.submit, launcher, poll_s=0.01)
    controller.launcher = launcher
    yield controller
    controller.close()
    runner.close()


def _done(controller, name, phase):
    return wait_for(
        lambda: (r := controller.get(name)).phase in (phase, GroupPhase.FAILED) and r, f"{name} {phase}", 60
    )


def test_add_fills_the_new_group_and_remove_drains_and_stops_one(mesh, controller):
    assert [(r.name, r.phase) for r in controller.records()] == [("g0", "serving"), ("g1", "serving")]
    started = controller.add(GroupRequest("g2"))
    assert started.phase is GroupPhase.STARTING
    with pytest.raises(GroupChangeRefused, match="one group change at a time"):
        controller.add(GroupRequest())
    added = _done(controller, "g2", GroupPhase.SERVING)
    assert added.phase is GroupPhase.SERVING, added.reason
    table = mesh.store.routing_table()
    assert set(table.placement().groups["g2"]) == mesh.held("g2") != set()
    assert added.moves_done == added.moves_planned > 0 and added.bytes_moved > 0
    assert added.requested_at <= added.registered_at <= added.first_listed_at <= added.finished_at
    assert (added.address, added.pid) == (mesh.groups["g2"].address, 4242)

    removing = controller.remove("g0")
    assert removing.phase is GroupPhase.DRAINING and removing.moves_planned == len(table.placement().groups["g0"])
    removed = _done(controller, "g0", GroupPhase.STOPPED)
    assert removed.phase is GroupPhase.STOPPED, removed.reason
    assert removed.exit_code == 0 and controller.launcher.stopped == ["g0"]
    table = mesh.store.routing_table()
    assert "g0" not in table.groups() and mesh.held("g0") == set()
    assert set(table.replicas) == {(layer, e) for layer in range(2) for e in range(4)}
    assert "g0" not in mesh.store.endpoints()
    controller.remove("g2")
    assert _done(controller, "g2", GroupPhase.STOPPED).phase is GroupPhase.STOPPED
    assert mesh.store.routing_table().groups() == ["g1"] and mesh.held("g1") == set(table.replicas)
    with pytest.raises(GroupChangeRefused, match="'g1' is the last expert group"):
        controller.remove("g1")


def test_refusals_leave_everything_as_it_was(mesh, controller):
    before = mesh.store.routing_table()
    with pytest.raises(GroupNotFound):
        controller.remove("g7")
    controller.launcher.refuse = "--island places a group on a Ray cluster"
    with pytest.raises(GroupChangeRefused, match="--island"):
        controller.add(GroupRequest(island="nvl-1"))
    assert mesh.store.routing_table() == before and controller.launcher.stopped == []


def test_a_group_whose_experts_fit_nowhere_else_is_not_removed(mesh, controller):
    mesh.groups["g1"].hosted.budget_bytes = 1  # less than it holds already: no room for one more expert
    before = mesh.store.routing_table()
    why = "cannot be placed: group g1 would need 96.0 KiB more for expert weights and has 0 B free in its budget"
    with pytest.raises(GroupChangeRefused, match=why):
        controller.remove("g0")
    assert mesh.store.routing_table() == before and controller.get("g0").phase is GroupPhase.SERVING
    assert controller.launcher.stopped == []


def test_a_fill_that_cannot_finish_fails_with_the_reason_and_the_group_can_still_be_removed(tiny_checkpoints):
    mesh = start_mesh(open_store("memory://"), tiny_checkpoints("mixtral"), target_budget=1)  # g2 holds nothing
    mesh.store.remove_endpoint("g2")
    runner = MigrationRunner(mesh.store, MigrationExecutor(mesh.store, **FAST))
    launcher = Launcher(mesh)
    controller = GroupController(mesh.store, runner.submit, launcher, poll_s=0.01)
    try:
        before = mesh.store.routing_table()
        controller.add(GroupRequest("g2"))
        failed = _done(controller, "g2", GroupPhase.SERVING)
        assert failed.phase is GroupPhase.FAILED and failed.reason.startswith("filling stopped: ")
        assert "the experts cannot be placed: group g2 would need " in failed.reason, failed.reason
        assert "B free in its budget; add a group or raise its budget first" in failed.reason
        assert mesh.store.routing_table().replicas == before.replicas  # every pair served where it was
        assert mesh.held("g2") == set()
        controller.remove("g2")
        removed = _done(controller, "g2", GroupPhase.STOPPED)
        assert removed.phase is GroupPhase.STOPPED and launcher.stopped == ["g2"]
        assert "g2" not in mesh.store.endpoints() and set(mesh.store.routing_table().groups()) == {"g0", "g1"}
    finally:
        controller.close()
        runner.close()
        for group in mesh.groups.values():
            group.server.stop(0)


def test_a_restarted_orchestrator_finishes_a_drain_the_last_one_left_half_done(mesh, controller, monkeypatch):
    """The crash is emulated: the first controller records g0 DRAINING (in the store) and its drain never runs,
    as when the orchestrator died right after; a second controller on the same store and groups resumes it."""
    controller.add(GroupRequest("g2"))
    assert _done(controller, "g2", GroupPhase.SERVING).phase is GroupPhase.SERVING
    monkeypatch.setattr(controller, "_run_remove", lambda name, change: None)  # dies before its first move
    controller.remove("g0")
    assert GroupRecord.from_json(mesh.store.group_records()["g0"]).phase is GroupPhase.DRAINING
    assert "g0" in mesh.store.routing_table().groups()
    runner = MigrationRunner(mesh.store, MigrationExecutor(mesh.store, **FAST))
    restarted = GroupController(mesh.store, runner.submit, controller.launcher, poll_s=0.01)
    try:
        assert restarted.get("g0").phase is GroupPhase.DRAINING  # its record, not a guess from the endpoints
        assert restarted.get("g2").phase is GroupPhase.SERVING and restarted.get("g2").moves_done > 0
        with pytest.raises(GroupChangeRefused, match="group g0 is draining"):
            restarted.add(GroupRequest())  # one change at a time holds across the restart too
        assert restarted.resume() == ["g0"]
        removed = _done(restarted, "g0", GroupPhase.STOPPED)
        assert removed.phase is GroupPhase.STOPPED, removed.reason
        assert removed.moves_done == removed.moves_planned > 0 and controller.launcher.stopped == ["g0"]
        assert "g0" not in mesh.store.routing_table().groups() and mesh.held("g0") == set()
        assert GroupRecord.from_json(mesh.store.group_records()["g0"]).phase is GroupPhase.STOPPED
    finally:
        restarted.close()
        runner.close()


def test_a_start_the_last_orchestrator_left_without_a_running_group_fails_with_a_line(mesh):
    mesh.store.save_group_record("g7", GroupRecord("g7", GroupPhase.STARTING, requested_at=1.0).to_json().encode())
    mesh.store.save_group_record("g8", b"not json at all")  # another version's record: left out, logged
    runner = MigrationRunner(mesh.store, MigrationExecutor(mesh.store, **FAST))
    controller = GroupController(mesh.store, runner.submit, Launcher(mesh), poll_s=0.01)
    try:
        assert controller.resume() == ["g7"]
        failed = controller.get("g7")
        assert failed.phase is GroupPhase.FAILED and "the orchestrator restarted while it started" in failed.reason
        assert "g8" not in [r.name for r in controller.records()]
    finally:
        controller.close()
        runner.close()


def test_no_launcher_lists_but_refuses_changes(mesh):
    runner = MigrationRunner(mesh.store, MigrationExecutor(mesh.store, **FAST))
    controller = GroupController(mesh.store, runner.submit, None)
    try:
        assert [r.name for r in controller.records()] == ["g0", "g1"]
        # no launcher: an orchestrator beside groups it cannot start (`up` runs one for its own groups)
        with pytest.raises(GroupChangeRefused, match="`expertmesh up --orchestrator`.* --ray-service NAME`"):
            controller.add(GroupRequest())
        assert GroupChangeRefused.code is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        controller.close()
        runner.close()


def test_the_admin_api_the_cli_and_the_kubectl_plugin(mesh, capsys):
    from expertmesh.cli.kubectl_plugin import main as kubectl_main
    from expertmesh.cli.main import main as cli_main
    from expertmesh.orchestrator.admin import start_orchestrator
    from expertmesh.v1 import admin_pb2 as pb
    from expertmesh.v1 import admin_pb2_grpc as pb_grpc

    launcher = Launcher(mesh)
    orchestrator = start_orchestrator(mesh.store, "127.0.0.1", 0, launcher=launcher)
    admin = f"127.0.0.1:{orchestrator.server.port}"
    channel = grpc.insecure_channel(admin)
    try:
        stub = pb_grpc.AdminStub(channel)
        for call, request, code, message in [
            (stub.AddGroup, pb.AddGroupRequest(name="g0"), grpc.StatusCode.INVALID_ARGUMENT, "exists already"),
            (stub.RemoveGroup, pb.RemoveGroupRequest(name="g9"), grpc.StatusCode.NOT_FOUND, "no running expert"),
            (stub.GetGroup, pb.GetGroupRequest(name="g9"), grpc.StatusCode.NOT_FOUND, "no expert group 'g9'"),
        ]:
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=10)
            assert refused.value.code() is code and message in refused.value.details()
        capsys.readouterr()
        assert cli_main(["groups", "add", "--name", "g2", "--wait", "--admin", admin]) == 0
        out = capsys.readouterr().out
        assert out.startswith("group g2 starting\n") and "\ng2    serving  " in out, out
        assert kubectl_main(["groups", "list", "--admin", admin]) == 0
        listed = capsys.readouterr().out.splitlines()
        assert listed[0].split() == ["NAME", "PHASE", "EXPERTS", "ADDRESS", "PID", "MOVES", "REASON"]
        assert [line.split()[:2] for line in listed[1:]] == [["g0", "serving"], ["g1", "serving"], ["g2", "serving"]]
        assert cli_main(["groups", "remove", "g0", "--wait", "--admin", admin]) == 0
        assert "\ng0    stopped  0 " in capsys.readouterr().out
        status = stub.GetGroup(pb.GetGroupRequest(name="g0"), timeout=10)
        assert status.phase == pb.GROUP_PHASE_STOPPED and status.exit_code == 0 and status.experts == 0
    finally:
        channel.close()
        orchestrator.stop()


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (dict(island="nvl-1"), "--island and --node place a group on a Ray cluster or Kubernetes"),
        (dict(node="w1"), "--island and --node place a group on a Ray cluster or Kubernetes"),
        (dict(gpus=2), "one GPU at most, not 2"),
        (dict(gpus=1), "this host has no CUDA GPU"),
    ],
)
@pytest.mark.parametrize("groups_as", ["process", "in-process"])
def test_the_embedded_platform_refuses_placements_it_cannot_make(request_, message, groups_as):
    """Group processes and groups in the platform's own process alike (each launcher's ``check``)."""
    import torch

    from expertmesh.expert_group.runtime import GroupSpec
    from expertmesh.platform.group_processes import ProcessGroups
    from expertmesh.platform.in_process_groups import InProcessGroups

    if request_.get("gpus") == 1 and torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    launcher = ProcessGroups([]) if groups_as == "process" else InProcessGroups(GroupSpec("", "unused", ()))
    with pytest.raises(GroupChangeRefused, match=message) as refused:
        launcher.check(**request_)
    if "--island" in message:
        assert f"`up --groups-as {groups_as}`" in str(refused.value)
    launcher.check()  # CPU, anywhere on this host: fine


def test_a_change_keeps_no_more_migrations_in_flight_than_the_runner_runs(mesh):
    """The whole plan used to be submitted at once: every record written and every pair checked in one burst,
    on the process that serves. Now at most ``max_active`` of the change's migrations are in flight."""
    runner = MigrationRunner(mesh.store, MigrationExecutor(mesh.store, **FAST), max_concurrent=2)
    in_flight_at_submit = []

    def submit(*args, **kwargs):
        records = load_all(mesh.store)
        in_flight_at_submit.append(sum(1 for m in records if m.initiator.startswith("group:") and not m.phase.terminal))
        return runner.submit(*args, **kwargs)

    controller = GroupController(mesh.store, submit, Launcher(mesh), poll_s=0.01, max_active=1)
    try:
        controller.add(GroupRequest("g2"))
        added = _done(controller, "g2", GroupPhase.SERVING)
        assert added.phase is GroupPhase.SERVING, added.reason
        assert len(in_flight_at_submit) == added.moves_planned > 1
        assert max(in_flight_at_submit) == 0  # each submitted once the one before it ended
    finally:
        controller.close()
        runner.close()
    with pytest.raises(ValueError):
        GroupController(mesh.store, submit, None, max_active=0)


def test_a_stopped_group_that_registers_again_is_serving_again(mesh, controller):
    """On Kubernetes a `helm upgrade` renders a chart group removed live back: its replica registers again. The
    orchestrator lists it SERVING again (no routing table lists it), so it can be removed again."""
    controller.add(GroupRequest("g2"))
    assert _done(controller, "g2", GroupPhase.SERVING).phase is GroupPhase.SERVING
    controller.remove("g2")
    assert _done(controller, "g2", GroupPhase.STOPPED).phase is GroupPhase.STOPPED
    assert "g2" not in mesh.store.endpoints()
    controller.launcher.running_groups["g2"] = (mesh.groups["g2"].address, 0)  # its platform started it again,
    mesh.store.set_endpoint("g2", mesh.groups["g2"].address)  # and it registered
    back = controller.get("g2")
    assert back.phase is GroupPhase.SERVING and "no routing table lists it" in back.reason
    assert "g2" not in mesh.store.routing_table().groups()
    controller.remove("g2")
    again = _done(controller, "g2", GroupPhase.STOPPED)
    assert again.phase is GroupPhase.STOPPED and again.moves_planned == 0, again.reason
    assert controller.launcher.stopped == ["g2", "g2"]


def test_a_group_just_stopped_is_not_read_back_to_life_from_an_endpoint_list_read_before_its_stop():
    """``records`` reads the store's endpoints, then the records under its lock: a remove's stop in between
    (endpoint removed, then the record marked STOPPED) left the list naming a group whose record is STOPPED, which
    ``records`` took for its platform starting it again and brought back as SERVING (seen in CI: the kube test's
    g4 "started again after it was stopped" 1 s after its stop). A group that really registered again still
    comes back SERVING."""

    class StaleOnce:  # the store, but its first endpoint list is the one from before the stop
        def __init__(self, store, stale):
            self._store, self._stale = store, stale

        def endpoints(self):
            stale, self._stale = self._stale, None
            return stale if stale is not None else self._store.endpoints()

        def __getattr__(self, name):
            return getattr(self._store, name)

    store = open_store("memory://")
    store.set_endpoint("g0", "127.0.0.1:1")
    store.save_group_record("g5", GroupRecord("g5", GroupPhase.STOPPED, address="127.0.0.1:5").to_json().encode())
    view = StaleOnce(store, {"g0": "127.0.0.1:1", "g5": "127.0.0.1:5"})
    controller = GroupController(view, lambda *a, **k: None, None)
    try:
        assert controller.get("g5").phase is GroupPhase.STOPPED
        store.set_endpoint("g5", "127.0.0.1:6")  # its platform started it again
        again = controller.get("g5")
        assert (again.phase, again.address) == (GroupPhase.SERVING, "127.0.0.1:6"), again
    finally:
        controller.close()
