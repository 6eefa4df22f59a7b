"""ExpertGroup objects (``kube.group_objects``, pure): the spec's bounds, ``plan``'s action for each case, the
status from a group record; and the controller's retries (``kube.group_objects_controller``) against the
in-process API server (kmock, real HTTP, the chart's CRD schema) with a stand-in for ``GroupController`` that
refuses a change the way its one-change-at-a-time check does. The groups' real adds and removes, through the
RayService launcher, are in test_kube_groups.py."""

from __future__ import annotations

from dataclasses import replace

import kubernetes
import pytest

from conftest import NAMESPACE
from expertmesh.contracts.errors import GroupChangeRefused, GroupNotFound, GroupSpecRefused
from expertmesh.orchestrator.elastic.controller import GroupRequest
from expertmesh.orchestrator.elastic.state import GroupPhase, GroupRecord
from expertmesh.orchestrator.kube.api import KubeApiError, connect
from expertmesh.orchestrator.kube.group_objects import (
    MAX_GPUS,
    Add,
    Delete,
    ExpertGroup,
    GroupObjectStatus,
    GroupSpec,
    Mirror,
    ObjectPhase,
    Refuse,
    Remove,
    manifest,
    plan,
    status_of,
)
from expertmesh.orchestrator.kube.group_objects_controller import ExpertGroupApi, ExpertGroupController

CHART = {"g0", "g1"}


def obj(name: str, phase: str = "", *, mirror: bool = False, created: str = "2026-12-05T12:00:00Z", **spec):
    doc = manifest(name, GroupSpec(**spec), mirror=mirror)
    doc["metadata"] |= {"creationTimestamp": created, "generation": 1}
    return ExpertGroup.from_dict(doc | {"status": {"phase": phase}})


def rec(name: str, phase: GroupPhase = GroupPhase.SERVING, **changes) -> GroupRecord:
    return GroupRecord(name, phase, **changes)


CHART_RECORDS = [rec("g0"), rec("g1")]


# -- the spec ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, problem",
    [
        ({"gpus": -1}, "spec.gpus must be an integer from 0 to 72"),
        ({"gpus": MAX_GPUS + 1}, "spec.gpus must be an integer from 0 to 72"),
        ({"gpus": True}, "spec.gpus"),
        ({"gpus": "2"}, "spec.gpus"),
        ({"island": "A"}, "spec.island must be an island of expertGroups.islands"),
        ({"island": "a" * 41}, "spec.island"),
        ({"island": "-a"}, "spec.island"),
        ({"node": "n" * 254}, "spec.node must be a node name of up to 253 characters"),
        ({"node": 3}, "spec.node"),
        ([], "spec must be an object"),
    ],
)
def test_a_spec_out_of_bounds_names_the_field(spec, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        GroupSpec.from_dict(spec)
    parsed = ExpertGroup.from_dict({"metadata": {"name": "g5"}, "spec": spec})
    assert parsed.spec is None and problem in parsed.spec_problem
    assert plan([parsed], CHART_RECORDS, [], CHART) == [Refuse("g5", "InvalidSpec", parsed.spec_problem)]


@pytest.mark.parametrize(
    "spec", [GroupSpec(), GroupSpec(MAX_GPUS, "a" * 40, "n" * 253), GroupSpec(0, "island-0", ""), GroupSpec(2)]
)
def test_the_bounds_themselves_are_taken_and_round_trip(spec):
    assert GroupSpec.from_dict(spec.to_dict()) == spec
    assert GroupSpec.from_dict(None) == GroupSpec()


def test_the_object_phases_are_the_group_lifecycle_and_the_two_before_it():
    assert [p.value for p in ObjectPhase] == [
        "Pending",
        *(p.value.capitalize() for p in GroupPhase),
        "Refused",
    ]


# -- plan: one case each ------------------------------------------------------------------------------------------


def test_an_object_whose_name_is_no_group_yet_adds_it_with_its_spec():
    assert plan([obj("g5", gpus=2, island="a")], CHART_RECORDS, [], CHART) == [Add("g5", GroupSpec(2, "a"))]
    # a group of that name stopped before: the name is free again
    assert plan([obj("g5")], [*CHART_RECORDS, rec("g5", GroupPhase.STOPPED)], [], CHART) == [Add("g5", GroupSpec())]


def test_a_pending_object_is_tried_again_oldest_first():
    older, newer = obj("g6", "Pending", created="2026-12-05T11:00:00Z"), obj("g5", created="2026-12-05T12:00:00Z")
    assert plan([newer, older], CHART_RECORDS, [], CHART) == [Add("g6", GroupSpec()), Add("g5", GroupSpec())]


@pytest.mark.parametrize(
    "name, reason",
    [("G5", "InvalidName"), ("g5.x", "InvalidName"), ("a" * 41, "InvalidName"), ("g0", "ChartGroup")],
)
def test_a_name_no_group_may_have_or_a_chart_groups_is_refused(name, reason):
    (action,) = plan([obj(name)], CHART_RECORDS, [], CHART)
    assert isinstance(action, Refuse) and (action.name, action.reason) == (name, reason)
    assert plan([obj(name, "Refused")], CHART_RECORDS, [], CHART) == [], "refused once, then left until deleted"


def test_an_object_named_after_a_group_added_another_way_adopts_it():
    assert plan([obj("g5")], [*CHART_RECORDS, rec("g5", GroupPhase.FILLING)], [], CHART) == []


def test_an_acted_object_follows_its_group_and_goes_when_the_group_was_removed_another_way():
    records = [*CHART_RECORDS, rec("g5")]
    assert plan([obj("g5", "Serving")], records, [], CHART) == []
    for gone in ([*CHART_RECORDS, rec("g5", GroupPhase.STOPPED)], CHART_RECORDS):
        assert plan([obj("g5", "Draining")], gone, [], CHART) == [Delete("g5")]
        assert plan([obj("g5", mirror=True)], gone, [], CHART) == [Delete("g5")], "a mirror never reported on"


def test_a_deleted_object_removes_its_group_unless_it_drains_or_stopped_already():
    records = [*CHART_RECORDS, rec("g5"), rec("g6", GroupPhase.FAILED), rec("g7", GroupPhase.DRAINING)]
    gone = [obj("g5", "Serving"), obj("g6", "Failed"), obj("g7", "Draining"), obj("g8", "Stopped")]
    assert plan([], records, gone, CHART) == [Remove("g5"), Remove("g6")]


def test_deleting_an_object_that_stood_for_no_group_removes_nothing():
    records = [*CHART_RECORDS, rec("g5")]
    refused_chart = obj("g0", "Refused")
    unparsed = ExpertGroup.from_dict({"metadata": {"name": "g5"}, "spec": {"gpus": -1}})
    assert plan([], records, [refused_chart, unparsed], CHART) == [Mirror("g5")]


def test_a_deleted_object_created_again_is_not_removed():
    records = [*CHART_RECORDS, rec("g5")]
    assert plan([obj("g5", "Serving")], records, [obj("g5", "Serving")], CHART) == []


def test_groups_added_another_way_are_mirrored_and_the_charts_never():
    records = [
        *CHART_RECORDS,
        rec("g5", GroupPhase.STARTING),
        rec("g6", GroupPhase.DRAINING),
        rec("g7", GroupPhase.STOPPED),
    ]
    assert plan([], records, [], CHART) == [Mirror("g5")]


def test_removals_come_before_adds():
    records = [*CHART_RECORDS, rec("g5")]
    assert plan([obj("g6")], records, [obj("g5", "Serving")], CHART) == [Remove("g5"), Add("g6", GroupSpec())]


# -- status --------------------------------------------------------------------------------------------------------


def test_the_status_follows_the_group_record():
    record = rec("g5", GroupPhase.FILLING, address="10.0.0.7:50102", moves_done=3, moves_planned=8, reason="")
    assert status_of(obj("g5", "Starting"), record) == GroupObjectStatus(
        "Filling", "", "", "10.0.0.7:50102", "3/8", observed_generation=1
    )
    failed = replace(record, phase=GroupPhase.FAILED, reason="filling stopped: layer 0 expert 1 ended failed")
    assert status_of(obj("g5", "Filling"), failed).phase == "Failed"
    assert status_of(obj("g5", "Filling"), failed).reason == "ChangeFailed"
    assert status_of(obj("g5", "Filling"), failed).message == failed.reason


def test_without_a_record_or_when_refused_the_status_stays():
    pending = obj("g5", "Pending")
    assert status_of(pending, None) == pending.status
    assert status_of(pending, rec("g5", GroupPhase.STOPPED)) == pending.status, "an old group of the same name"
    refused_chart = obj("g0", "Refused")
    assert status_of(refused_chart, rec("g0")) == refused_chart.status


# -- the controller's retries, against the API server ----------------------------------------------------------


class OneChangeAtATime:
    """Stands in for ``GroupController``: ``busy`` is a change in flight, which refuses any other with
    ``checked_add``'s words; an add or remove otherwise takes effect at once."""

    def __init__(self, records: list[GroupRecord]):
        self.records_ = {r.name: r for r in records}
        self.busy = ""
        self.cpu_only = True
        self.calls: list[tuple[str, str]] = []

    def records(self) -> list[GroupRecord]:
        return list(self.records_.values())

    def _refuse_if_busy(self) -> None:
        if self.busy:
            raise GroupChangeRefused(f"group {self.busy} is filling (1/8 moves); one group change at a time")

    def add(self, request: GroupRequest) -> GroupRecord:
        self.calls.append(("add", request.name))
        if request.gpus and self.cpu_only:  # what the launcher says of a spec it can never place
            raise GroupSpecRefused(f"--gpus {request.gpus}: the chart runs its expert groups on CPU (mode: cpu)")
        self._refuse_if_busy()
        self.records_[request.name] = rec(request.name, GroupPhase.STARTING)
        return self.records_[request.name]

    def remove(self, name: str) -> GroupRecord:
        self.calls.append(("remove", name))
        if name not in self.records_:
            raise GroupNotFound(name)
        self._refuse_if_busy()
        self.records_[name] = rec(name, GroupPhase.DRAINING)
        return self.records_[name]


@pytest.fixture
def connection(kubeconfig):
    return connect(str(kubeconfig))


def _statuses(api) -> dict[str, GroupObjectStatus]:
    return {o.name: o.status for o in api.list(NAMESPACE)}


def _events(connection, name: str) -> list[tuple[str, str]]:
    items = kubernetes.client.CoreV1Api(connection.client).list_namespaced_event(NAMESPACE).items
    return [(e.type, e.reason) for e in items if e.involved_object.name == name]


def test_an_add_refused_for_now_stays_pending_and_is_tried_again(connection):
    groups = OneChangeAtATime([*CHART_RECORDS, rec("g4", GroupPhase.FILLING)])
    groups.busy = "g4"
    api = ExpertGroupApi(connection)
    controller = ExpertGroupController(api, groups, lambda: CHART, NAMESPACE)
    api.create(NAMESPACE, manifest("g5", GroupSpec(island="a")))
    controller.sync_once()
    status = _statuses(api)["g5"]
    assert (status.phase, status.reason) == ("Pending", "GroupChangeRefused")
    assert "one group change at a time" in status.message
    assert _statuses(api)["g4"].phase == "Filling" and api.get(NAMESPACE, "g4").mirror, "g4 mirrored"
    controller.sync_once()
    assert groups.calls == [("add", "g5"), ("add", "g5")] and _events(connection, "g5") == [("Warning", "Pending")]

    groups.busy = ""
    controller.sync_once()
    assert _statuses(api)["g5"].phase == "Starting"
    assert _events(connection, "g5") == [("Warning", "Pending"), ("Normal", "Starting")]


def test_an_add_the_platform_can_never_place_is_refused_and_not_asked_again(connection):
    """GPUs on a CPU chart: Pending and retried every pass (each a read of the RayService) before the launcher's
    refusals were typed; now Refused, as a bad name is: another spec (a new object) or platform is needed."""
    groups = OneChangeAtATime(list(CHART_RECORDS))
    api = ExpertGroupApi(connection)
    controller = ExpertGroupController(api, groups, lambda: CHART, NAMESPACE)
    api.create(NAMESPACE, manifest("g5", GroupSpec(gpus=1)))
    controller.sync_once()
    status = _statuses(api)["g5"]
    assert (status.phase, status.reason) == ("Refused", "GroupSpecRefused") and "on CPU" in status.message
    controller.sync_once()
    assert groups.calls == [("add", "g5")] and _events(connection, "g5") == [("Warning", "Refused")]


def test_a_removal_refused_for_now_is_tried_again_after_the_object_is_gone(connection):
    groups = OneChangeAtATime([*CHART_RECORDS, rec("g5"), rec("g6")])
    api = ExpertGroupApi(connection)
    controller = ExpertGroupController(api, groups, lambda: CHART, NAMESPACE)
    controller.sync_once()
    assert {n: s.phase for n, s in _statuses(api).items()} == {"g5": "Serving", "g6": "Serving"}, "mirrors"
    groups.busy = "g6"
    api.delete(api.get(NAMESPACE, "g5"))
    controller.sync_once()
    controller.sync_once()
    assert groups.calls == [("remove", "g5"), ("remove", "g5")] and groups.records_["g5"].phase is GroupPhase.SERVING
    assert "g5" not in _statuses(api), "not mirrored again while its removal waits"
    groups.busy = ""
    controller.sync_once()
    assert groups.records_["g5"].phase is GroupPhase.DRAINING
    groups.records_["g5"] = rec("g5", GroupPhase.STOPPED)
    controller.sync_once()
    assert set(_statuses(api)) == {"g6"} and len(groups.calls) == 3


@pytest.mark.parametrize("spec", [{"gpus": MAX_GPUS + 1}, {"island": "Island A"}, {"node": ""}])
def test_the_api_server_refuses_a_spec_outside_the_schema_before_the_controller_sees_it(connection, spec):
    with pytest.raises(KubeApiError, match="422"):
        ExpertGroupApi(connection).create(NAMESPACE, manifest("g5", GroupSpec()) | {"spec": spec})
