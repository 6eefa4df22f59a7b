"""GPU paths chosen at run time, with only the device query faked: what Ray reports
about the cluster's resources, and whether torch sees CUDA in the replica."""

import ray

from expertmesh.expert_group import deployment
from expertmesh.expert_group.deployment import GroupSpec, actor_options, hardware_binding
from expertmesh.orchestrator.placement.groups import GroupHardware

HW = GroupHardware(node="n0", island="nvl-0", gpu_ids=(4, 5), numa=1)


def test_gpus_are_requested_only_when_the_cluster_has_them(monkeypatch):
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    assert not deployment.cluster_has_gpus()
    assert "num_gpus" not in actor_options(GroupSpec("g0", "/m", ((0, 0),), num_gpus=0))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0})
    assert deployment.cluster_has_gpus()
    assert actor_options(GroupSpec("g0", "/m", ((0, 0),), num_gpus=1)) == {"num_cpus": 0.25, "num_gpus": 1}


def test_hardware_binding_on_gpu_and_cpu_clusters(monkeypatch):
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 8.0, "expertmesh.io/island-nvl-0": 4.0})
    binding = hardware_binding(HW, has_gpus=True)
    assert binding == {"num_gpus": 2, "resources": {"expertmesh.io/island-nvl-0": 1}, "numa": 1}
    spec = GroupSpec("gpu-4", "/m", ((0, 0),), **binding)
    assert actor_options(spec) == {"num_cpus": 0.25, "num_gpus": 2, "resources": {"expertmesh.io/island-nvl-0": 1}}
    # A cluster whose nodes do not declare island resources: GPUs only.
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 8.0})
    assert hardware_binding(HW, has_gpus=True)["resources"] == {}
    # No GPUs at all: the same plan runs as logical groups on CPU.
    assert hardware_binding(HW, has_gpus=False) == {}
