"""Expert groups added and removed live on the default platform, where the groups are Ray Serve deployments
(``platform.ray_groups``): what Ray cannot place refused as pure checks, then the short ``expertmesh bench
elastic`` run of ``test_elastic_groups_live`` with ``--groups-as ray`` — ``expertmesh up --orchestrator``
(joining this module's Ray) under looping streaming greedy clients while AddGroup deploys an empty group
that live moves fill, and RemoveGroup drains g0 and deletes its deployment.

Every answer is compared token by token with stock transformers; no request may fail. Serve's own list of
the groups application's deployments is sampled from this process while the bench runs: it goes from g0,
g1 to g0, g1, g2 to g1, g2, and g1's replica (its pid) is the one it was. Timings are recorded, never
asserted.
"""

from __future__ import annotations

import threading

import pytest

from expertmesh.bench.elastic import run, table
from expertmesh.contracts.topology import ISLAND_RESOURCE_PREFIX as ISLAND_PREFIX
from expertmesh.platform.ray_groups import RayNode, placement_refusal, room_shortfall
from test_elastic_groups_live import short_run

CLIENTS, STEP = 2, 1

CPU_NODE = RayNode("n1", "10.0.0.1", "cpu-1", {"CPU": 8, "node:10.0.0.1": 1})
GPU_NODES = [
    RayNode("n2", "10.0.0.2", "gpu-1", {"CPU": 16, "GPU": 4, f"{ISLAND_PREFIX}nvl-0": 4}),
    RayNode("n3", "10.0.0.3", "gpu-2", {"CPU": 16, "GPU": 4, f"{ISLAND_PREFIX}nvl-1": 4}),
]
GPU_FREE = {"CPU": 32, "GPU": 8, f"{ISLAND_PREFIX}nvl-0": 4, f"{ISLAND_PREFIX}nvl-1": 4}
#: the GPU nodes under one host name, as nodes in containers or network namespaces of one machine have it
SAME_HOST = [RayNode(n.id, n.ip, "box", n.resources) for n in GPU_NODES]


@pytest.mark.parametrize(
    ("nodes", "free", "request_", "message"),
    [
        ([CPU_NODE], {"CPU": 8}, dict(gpus=1), "--gpus 1: the Ray cluster has no GPUs; leave --gpus out"),
        ([CPU_NODE], {"CPU": 8}, dict(node="w9"), "--node w9: no alive node of the Ray cluster has that ID, IP or"),
        (GPU_NODES, GPU_FREE, dict(gpus=1, island="nvl-7"), "--island nvl-7: no node of the Ray cluster declares it"),
        (GPU_NODES, GPU_FREE, dict(gpus=1, island="nvl-0", node="gpu-2"), "that node is not on island nvl-0"),
        (GPU_NODES, GPU_FREE, dict(gpus=8), r"no Ray node has 8 GPU\(s\) and 0.25 CPU\(s\) for the group \(the most"),
        (GPU_NODES, {**GPU_FREE, "GPU": 0}, dict(gpus=1), "has 0 of its 8 GPUs free and the group needs 1: remove"),
        ([CPU_NODE], {"CPU": 0.1}, dict(gpus=0), "has 0.1 of its 8 CPUs free and the group needs 0.25"),
        (GPU_NODES, {**GPU_FREE, f"{ISLAND_PREFIX}nvl-1": 0}, dict(gpus=1, island="nvl-1"), "island nvl-1's slots"),
        (GPU_NODES, GPU_FREE, dict(node="w9"), r"its nodes: gpu-1 at 10.0.0.2, gpu-2 at 10.0.0.3\)$"),
        (
            SAME_HOST,
            GPU_FREE,
            dict(node="box"),
            r"^--node box: 2 Ray nodes have that host name \(at 10.0.0.2, 10.0.0.3\); name one",
        ),
    ],
)
def test_what_ray_cannot_place_is_refused_with_one_line(nodes, free, request_, message):
    import re

    request_ = {"gpus": 0, "island": "", "node": "", "num_cpus": 0.25} | request_
    why = placement_refusal(nodes, free, **request_)
    assert why is not None and re.search(message, why), why
    assert "\n" not in why


@pytest.mark.parametrize(
    ("nodes", "free", "request_"),
    [
        ([CPU_NODE], {"CPU": 8}, dict()),
        ([CPU_NODE], {"CPU": 8}, dict(node="cpu-1")),
        ([CPU_NODE], {"CPU": 8}, dict(node="10.0.0.1")),
        (GPU_NODES, GPU_FREE, dict(gpus=1)),
        (GPU_NODES, GPU_FREE, dict(gpus=4, island="nvl-1", node="n3")),
        (SAME_HOST, GPU_FREE, dict(node="10.0.0.3")),
    ],
)
def test_what_ray_can_place_passes(nodes, free, request_):
    request_ = {"gpus": 0, "island": "", "node": "", "num_cpus": 0.25} | request_
    assert placement_refusal(nodes, free, **request_) is None


@pytest.mark.parametrize(
    ("free", "request_", "short"),
    [
        ({**GPU_FREE, "GPU": 0}, dict(gpus=1), "the Ray cluster has 0 of its 8 GPUs free and the group needs 1"),
        (
            {**GPU_FREE, "CPU": 0.1},
            dict(gpus=1),
            "the Ray cluster has 0.1 of its 32 CPUs free and the group needs 0.25",
        ),
        (
            {**GPU_FREE, f"{ISLAND_PREFIX}nvl-1": 0},
            dict(gpus=1, island="nvl-1"),
            f"has 0 of its 4 island nvl-1's slots ({ISLAND_PREFIX}nvl-1) free and the group needs 1",
        ),
    ],
)
def test_room_lacking_now_is_a_shortfall_that_waiting_may_end_and_not_a_refusal(free, request_, short):
    """What a node added or a group removed can end (room) is told apart from what nothing can (no such island,
    no node that large): with the platform waiting for room, only the latter refuses."""
    request_ = {"gpus": 0, "island": ""} | request_
    assert short in room_shortfall(GPU_NODES, free, num_cpus=0.25, **request_)
    assert short in placement_refusal(GPU_NODES, free, node="", num_cpus=0.25, **request_)  # refused by default
    assert placement_refusal(GPU_NODES, free, node="", num_cpus=0.25, need_room_now=False, **request_) is None
    assert room_shortfall(GPU_NODES, GPU_FREE, num_cpus=0.25, **request_) is None
    whole = {"gpus": 8, "island": ""}  # no node has 8 GPUs: no room to wait for
    why = placement_refusal(GPU_NODES, GPU_FREE, node="", num_cpus=0.25, need_room_now=False, **whole)
    assert why is not None and "no Ray node has 8 GPU(s)" in why


def test_the_island_resource_is_the_platforms():
    from expertmesh.contracts.topology import island_resource

    assert island_resource("nvl-3") == f"{ISLAND_PREFIX}nvl-3"


class _App:
    """``GroupsApp`` stand-in: records the specs added and the names removed."""

    def __init__(self):
        self.specs, self.removed = {}, []

    def add(self, spec, timeout_s=300.0):
        self.specs[spec.name] = spec
        self.timeouts = [*getattr(self, "timeouts", []), timeout_s]
        return f"10.0.0.3:{5000 + len(self.specs)}", 4242

    def remove(self, name):
        self.removed.append(self.specs.pop(name))

    def replicas(self):
        return {name: ("10.0.0.3:5000", 4242) for name in self.specs}


@pytest.fixture
def gpu_cluster(monkeypatch, tiny_checkpoints):
    """``RayGroups`` over a stand-in plane on the two GPU nodes above (Ray's queries faked)."""
    from types import SimpleNamespace

    from expertmesh.config.settings import DataPlaneConfig
    from expertmesh.expert_group import deployment
    from expertmesh.models.checkpoint import Checkpoint
    from expertmesh.platform.ray_groups import RayGroups
    from expertmesh.store import open_store

    nodes = [{"id": n.id, "ip": n.ip, "host": n.host, "resources": dict(n.resources)} for n in GPU_NODES]
    monkeypatch.setattr(deployment, "cluster_nodes", lambda: nodes)
    monkeypatch.setattr(deployment, "free_resources", lambda: dict(GPU_FREE))
    model = tiny_checkpoints("mixtral", num_local_experts=8)
    store = open_store("memory://", "ray-groups")
    plane = SimpleNamespace(
        groups_app=_App(),
        config=DataPlaneConfig(model=model),
        checkpoint=Checkpoint(model),
        store=store,
        addresses={},
    )
    yield RayGroups(plane), plane
    store.close()


def test_a_group_added_on_a_gpu_cluster_gets_its_gpus_island_and_node_and_starts_empty(gpu_cluster):
    from expertmesh.contracts.errors import GroupChangeRefused

    launcher, plane = gpu_cluster
    assert launcher.start("g2", gpus=2, island="nvl-1", node="gpu-2") == ("10.0.0.3:5001", 4242)
    spec = plane.groups_app.specs["g2"]
    assert (spec.pairs, spec.num_gpus, spec.num_cpus) == ((), 2, plane.config.group_num_cpus)
    assert spec.resources == {f"{ISLAND_PREFIX}nvl-1": 1, "node:10.0.0.3": 0.001}
    assert spec.table_after == plane.store.routing_table_version()  # a restarted replica follows later tables
    assert plane.addresses == {"g2": "10.0.0.3:5001"}
    launcher.start("g3")  # as the platform's groups run: one GPU each on a GPU cluster, anywhere
    assert (plane.groups_app.specs["g3"].num_gpus, plane.groups_app.specs["g3"].resources) == (1, {})
    with pytest.raises(GroupChangeRefused, match="--island nvl-9: no node of the Ray cluster declares it"):
        launcher.start("g4", island="nvl-9")
    assert sorted(plane.groups_app.specs) == ["g2", "g3"]  # nothing started for a refusal
    assert launcher.stop("g2") == 0 and plane.addresses == {"g3": "10.0.0.3:5002"}
    assert sorted(launcher.running()) == ["g3"]


def test_a_group_added_by_node_ip_where_nodes_share_a_host_name_is_pinned_to_that_ip(gpu_cluster, monkeypatch):
    """Nodes of one machine's containers or network namespaces (the multi-node test bed) share a host name: the
    group goes on the node of the IP given; the shared name, which names no one node, is refused."""
    from expertmesh.contracts.errors import GroupChangeRefused
    from expertmesh.expert_group import deployment

    launcher, plane = gpu_cluster
    nodes = [{"id": n.id, "ip": n.ip, "host": n.host, "resources": dict(n.resources)} for n in SAME_HOST]
    monkeypatch.setattr(deployment, "cluster_nodes", lambda: nodes)
    launcher.start("g2", node="10.0.0.3")
    assert plane.groups_app.specs["g2"].resources == {"node:10.0.0.3": 0.001}
    with pytest.raises(GroupChangeRefused, match="2 Ray nodes have that host name"):
        launcher.check(node="box")
    assert sorted(plane.groups_app.specs) == ["g2"]


def test_a_group_without_room_now_waits_for_it_when_the_platform_waits(gpu_cluster, monkeypatch):
    """``group_wait_for_room_s``: deployed all the same (its replica a pending demand the autoscaler sees), waited
    for that long; without it, refused with the way out."""
    from expertmesh.contracts.errors import GroupChangeRefused, GroupSpecRefused
    from expertmesh.expert_group import deployment

    launcher, plane = gpu_cluster
    monkeypatch.setattr(deployment, "free_resources", lambda: {**GPU_FREE, "GPU": 0})
    with pytest.raises(GroupChangeRefused, match=r"needs 1: remove a group first .*up --group-wait-for-room-s") as now:
        launcher.check()
    assert not isinstance(now.value, GroupSpecRefused)  # room may come: an ExpertGroup object waits for it
    plane.config = plane.config.model_copy(update={"group_wait_for_room_s": 900.0})
    launcher.check()  # no refusal: room may come
    launcher.start("g2")
    assert plane.groups_app.timeouts == [900.0]
    with pytest.raises(GroupSpecRefused, match="--island nvl-9: no node of the Ray cluster declares it"):
        launcher.check(island="nvl-9")  # what no room can fix is still refused, and typed so


# -- live: expertmesh up --orchestrator with its groups on Ray Serve ------------------------------------


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return tiny_checkpoints("mixtral", num_local_experts=8)


class _ServeWatch:
    """The groups application's deployments as Serve's controller lists them, sampled every ``poll_s`` from
    this process (connected to the same Ray): each distinct set in the order seen, and each group's replica
    pids."""

    def __init__(self, poll_s: float = 0.1):
        self.seen: list[frozenset[str]] = []
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._watch, name="serve-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from expertmesh.expert_group import deployment

        while not self._stop.wait(self._poll_s):
            try:
                statuses = deployment.app_status().deployment_statuses
            except Exception:  # Serve not started yet by the platform, or going down
                continue
            groups = frozenset(d.name.removeprefix("group-") for d in statuses if d.name.startswith("group-"))
            if groups and (not self.seen or self.seen[-1] != groups):
                self.seen.append(groups)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
def test_ray_serve_groups_added_and_removed_under_streaming_load_fail_nothing_and_change_no_token(
    model, tmp_path, monkeypatch, record_property, shared_ray_address
):
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path / "home"))
    options = short_run(model, CLIENTS, STEP, groups_as="ray", ray_address=shared_ray_address)
    watch = _ServeWatch()
    try:
        result = run(options)
    finally:
        watch.stop()
    print("\n" + table(result))

    (cycle,) = result["cycles"]
    before, after, add, remove = result["groups_before"], result["groups_after"], cycle["add"], cycle["remove"]
    assert {n: g["phase"] for n, g in before.items()} == {"g0": "serving", "g1": "serving"}
    assert result["requests"]["failed"] == 0, result["requests"].get("first_failure")
    assert result["requests"]["differing_from_stock"] == 0
    assert all(p["failed"] == 0 and p["differing"] == 0 and p["tokens"] > 0 for p in cycle["phases"])

    # -- add: one more deployment in the groups application, empty, filled by live moves, served tokens
    assert add["group"] == "g2" and add["phase"] == "serving", add["reason"]
    assert add["experts"] > 0 and add["moves"] == add["moves_planned"] > 0 and add["bytes_moved"] > 0
    assert add["experts_held"] == add["experts"]
    assert 0 < add["to_first_token_s"] and 0 < add["to_listed_s"] <= add["to_serving_s"]

    # -- remove: g0 drained, then its deployment deleted (Serve stopped its replica; its worker ended)
    assert remove["group"] == "g0" and remove["phase"] == "stopped", remove["reason"]
    assert remove["experts"] == 0 and remove["exit_code"] == 0 and remove["group_ended"]
    assert remove["moves"] == remove["moves_planned"] > 0

    # Serve's deployments: g0, g1 -> + g2 -> - g0 (the last set seen while the platform still served)
    assert watch.seen[:3] == [{"g0", "g1"}, {"g0", "g1", "g2"}, {"g1", "g2"}], watch.seen
    # nothing else restarts: g1 is the replica (the worker process) it was
    assert after["g1"]["pid"] == before["g1"]["pid"]
    assert sorted(n for n, g in after.items() if g["phase"] == "serving") == ["g1", "g2"]
    assert sum(g["experts"] for g in after.values()) == 2 * 8
    assert result["platform_served_on"] and result["platform_exit_code"] == 0

    for key, value in {
        "add_to_first_token_s": add["to_first_token_s"],
        "add_to_serving_s": add["to_serving_s"],
        "remove_to_stopped_s": remove["to_stopped_s"],
        "remove_stop_after_drain_s": remove["stop_after_drain_s"],
        "requests": result["requests"]["completed"],
    }.items():
        record_property(key, value)
