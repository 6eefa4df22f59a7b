"""Fidelity of the whole data plane to stock transformers: real Ray Serve
replicas (one per expert group) serving real gRPC, a router built without
routed-expert weights, compared on every architecture we claim, in float32 across
three groups and in bfloat16 in one."""

import pytest
import yaml
from ray import serve
from ray.serve.schema import ApplicationStatus

from expertmesh.config.settings import DataPlaneConfig
from expertmesh.contracts.errors import PlacementError
from expertmesh.expert_group import deployment
from expertmesh.infra.security.admin_auth import admin_metadata
from expertmesh.models.tiny import MOE_ARCHITECTURES
from expertmesh.platform.data_plane import DataPlane
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.verify import check as verify

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


#: Each architecture twice, not four times: the group count (how the dispatch splits a layer's experts)
#: and the dtype (what the weights and the wire carry) are independent, so float32 across three groups and
#: bfloat16 in one cover both of each with half the Serve deployments (each costs 10-30 s on 2 cores).
SPLITS_AND_DTYPES = [(3, "float32"), (1, "bfloat16")]


@pytest.mark.parametrize("groups, dtype", SPLITS_AND_DTYPES)
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_platform_matches_transformers(tiny_checkpoints, arch, groups, dtype):
    config = DataPlaneConfig(model=tiny_checkpoints(arch), groups=groups, dtype=dtype)
    with DataPlane.start(config) as plane:
        assert len(set(plane.addresses.values())) == groups, "each group is its own Serve replica and server"
        report = verify.compare(plane, tokens=24)
    assert report.tokens_equal, report.summary()
    assert report.max_abs_diff <= (1e-5 if dtype == "float32" else 1e-2), report.summary()
    assert report.passed


def test_placement_file_with_hot_replica_and_live_load(tiny_checkpoints, tmp_path):
    """A placement with a second replica of a hot expert, then experts loaded into
    a running group over gRPC: the routing table and the groups stay exact."""
    path = tiny_checkpoints("mixtral")
    placement = tmp_path / "placement.yaml"
    placement.write_text(yaml.safe_dump({"groups": {"a": {"*": ["0-1"]}, "b": {"*": ["2-3"]}, "hot": {1: [0]}}}))
    config = DataPlaneConfig(model=path, placement=placement)
    with DataPlane.start(config) as plane:
        status = deployment.app_status()  # what deploy waited on, from Serve's controller
        assert status.app_status.status == ApplicationStatus.RUNNING
        assert {d.name: d.status for d in status.deployment_statuses} == {
            "directory": "HEALTHY",
            "group-a": "HEALTHY",
            "group-b": "HEALTHY",
            "group-hot": "HEALTHY",
        }
        table = plane.store.routing_table()
        assert table.replicas[(1, 0)] == ("a", "hot")
        assert verify.compare(plane, tokens=16).passed

        from expertmesh.infra.group_channels import GroupClients

        clients = GroupClients()
        clients.update(plane.addresses)
        described = clients.stub("hot").Describe(pb.DescribeRequest())
        assert [(r.layer, r.expert) for r in described.experts] == [(1, 0)]
        clients.stub("hot").LoadExperts(
            pb.LoadExpertsRequest(experts=[pb.ExpertRef(layer=0, expert=e) for e in range(4)]),
            metadata=admin_metadata(),
        )
        # Route all of layer 0 to the "hot" group: a new table version, picked up at the next step.
        from expertmesh.contracts.routing_table import RoutingTable

        moved = dict(table.replicas)
        for e in range(4):
            moved[(0, e)] = ("hot",)
        assert plane.store.publish_routing_table(RoutingTable(table.version + 1, table.num_experts, moved))
        # The watcher's thread reads the store every 0.25 s; a compare can be over before its next round, so
        # the round runs now (as the thread would): the next step swaps the new view in.
        assert plane.watcher.poll_once()
        report = verify.compare(plane, tokens=16)
        assert plane.watcher.table.version == table.version + 1
        assert report.passed, report.summary()
        clients.close()
    assert deployment.app_status().app_status.status == ApplicationStatus.NOT_STARTED  # close waited for it to go


@pytest.mark.parametrize(
    "groups_yaml, message",
    [
        ({"a": {"*": ["0-2"]}}, "leaves 2 experts unhosted"),
        ({"a": {"*": ["0-3"]}, "b": {0: [4]}}, "expert 4 of layer 0, which does not exist"),
    ],
)
def test_bad_placement_is_refused_before_anything_starts(tiny_checkpoints, tmp_path, groups_yaml, message):
    placement = tmp_path / "placement.yaml"
    placement.write_text(yaml.safe_dump({"groups": groups_yaml}))
    with pytest.raises(PlacementError, match=message):
        DataPlane.start(DataPlaneConfig(model=tiny_checkpoints("mixtral"), placement=placement))
    assert "expertmesh-groups" not in serve.status().applications


def test_planned_gpu_placement_with_hot_replicas_runs_as_logical_groups(tiny_checkpoints, tmp_path):
    """`expertmesh plan` output (replicas of hot experts on GPUs, with shares) applied to
    running groups: on this GPU-less machine each GPU becomes a logical group on CPU,
    replicated experts' tokens are split across their replicas, and verify still passes."""
    import json

    import numpy as np

    from expertmesh.contracts.gpu_plan import placement_to_dict
    from expertmesh.contracts.topology import topology_from_dict
    from expertmesh.orchestrator.placement.planner import PlanOptions, plan
    from expertmesh.orchestrator.placement.stats import LoadStats

    path = tiny_checkpoints("deepseek_v3")  # 8 experts, MoE layer 1 only
    topo_doc = {
        "nodes": [
            {
                "name": "n0",
                "islands": [
                    {"name": "a", "numa": 0, "gpus": [{"id": 0, "memory_gb": 80}, {"id": 1, "memory_gb": 80}]},
                    {"name": "b", "numa": 0, "gpus": [{"id": 2, "memory_gb": 80}, {"id": 3, "memory_gb": 80}]},
                ],
            }
        ]
    }
    load = np.array([[400.0, 300, 20, 20, 10, 10, 5, 5]])  # two hot experts
    result = plan(LoadStats(1, 8, 2, load), topology_from_dict(topo_doc), PlanOptions(redundant=4))
    (tmp_path / "placement.json").write_text(json.dumps(placement_to_dict(result.placement)))
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo_doc))

    config = DataPlaneConfig(model=path, gpu_placement=tmp_path / "placement.json", topology=tmp_path / "topo.yaml")
    with DataPlane.start(config) as plane:
        table = plane.store.routing_table()
        replicated = {pair: g for pair, g in table.replicas.items() if len(g) > 1}
        assert (1, 0) in replicated and (1, 1) in replicated, "the hot experts have replicas"
        assert set(plane.placement.groups) <= {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}
        report = verify.compare(plane, tokens=24)
        assert report.passed, report.summary()
        sent = plane.dispatcher.traffic.group_tokens()
        for groups in replicated.values():
            assert all(sent.get(g, 0) > 0 for g in groups), f"every replica takes tokens: {sent}"
