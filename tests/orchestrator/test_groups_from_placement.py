"""GPU placement -> expert groups (pure), share splitting, and NUMA pinning with a faked sysfs."""

import os

import numpy as np
import pytest

from expertmesh.contracts.errors import PlacementError
from expertmesh.contracts.gpu_plan import Placement
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.contracts.topology import topology_from_dict
from expertmesh.expert_group.runtime import parse_cpulist, pin_to_numa_node
from expertmesh.orchestrator.placement.to_groups import groups_from_placement

TOPO = topology_from_dict(
    {
        "nodes": [
            {
                "name": "n0",
                "islands": [
                    {"name": "a", "numa": 0, "gpus": [{"id": 0, "memory_gb": 80}, {"id": 1, "memory_gb": 80}]},
                    {"name": "b", "numa": 1, "gpus": [{"id": 2, "memory_gb": 80}, {"id": 3, "memory_gb": 80}]},
                ],
            }
        ]
    }
)


def _placement():
    shares = np.zeros((1, 4, 4))  # one MoE layer, 4 experts, 4 GPUs
    shares[0, 0, [0, 1, 2]] = [0.5, 0.25, 0.25]  # hot expert 0: three replicas
    shares[0, 1, 1] = shares[0, 2, 2] = shares[0, 3, 3] = 1.0
    return Placement((0, 1, 2, 3), shares)


def test_group_per_gpu():
    layout = groups_from_placement(_placement(), TOPO, moe_layers=(3,), per="gpu")
    assert layout.placement.groups == {
        "gpu-0": ((3, 0),),
        "gpu-1": ((3, 0), (3, 1)),
        "gpu-2": ((3, 0), (3, 2)),
        "gpu-3": ((3, 3),),
    }
    assert layout.shares[(3, 0)] == {"gpu-0": 0.5, "gpu-1": 0.25, "gpu-2": 0.25}
    assert layout.hardware["gpu-2"].island == "b" and layout.hardware["gpu-2"].numa == 1
    table = RoutingTable.from_placement(layout.placement, 4, shares=layout.shares)
    assert table.shares_of((3, 0)) == (0.5, 0.25, 0.25) and table.shares_of((3, 1)) == (1.0,)
    assert RoutingTable.from_json(table.to_json()) == table


def test_group_per_island_adds_shares():
    layout = groups_from_placement(_placement(), TOPO, moe_layers=(3,), per="island")
    assert layout.placement.groups == {"n0-a": ((3, 0), (3, 1)), "n0-b": ((3, 0), (3, 2), (3, 3))}
    assert layout.shares[(3, 0)] == {"n0-a": 0.75, "n0-b": 0.25}
    assert layout.hardware["n0-a"].gpu_ids == (0, 1)


def test_layer_count_must_match_the_model():
    with pytest.raises(PlacementError, match="1 layers but the model has 2 MoE layers"):
        groups_from_placement(_placement(), TOPO, moe_layers=(1, 2))


def test_numa_pinning_reads_the_node_cpulist(tmp_path):
    """Only the device query is faked: a sysfs tree with the node's cpulist."""
    assert parse_cpulist("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
    (tmp_path / "node0").mkdir()
    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "node0" / "cpulist").write_text(f"{allowed[0]}\n")
    try:
        assert pin_to_numa_node(0, sysfs=str(tmp_path)) == [allowed[0]]
        assert os.sched_getaffinity(0) == {allowed[0]}
    finally:
        os.sched_setaffinity(0, allowed)
    assert pin_to_numa_node(7, sysfs=str(tmp_path)) == []
