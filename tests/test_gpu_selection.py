"""GPU paths chosen at run time, with only the device query faked: what Ray reports
about the cluster's resources, and whether torch sees CUDA in the replica."""

import ray

from expertmesh.expert_group import deployment
from expertmesh.expert_group.deployment import GroupSpec, actor_options, hardware_binding
from expertmesh.orchestrator.placement.to_groups import GroupHardware

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


# -- the router's device: only torch's CUDA queries are faked -------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402

from expertmesh.cli.main import main  # noqa: E402
from expertmesh.contracts.errors import DeviceUnavailable  # noqa: E402
from expertmesh.infra.devices import router_device  # noqa: E402


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_the_router_takes_the_first_gpu_when_there_is_one(monkeypatch):
    _gpus(monkeypatch, 2)
    assert router_device("auto") == torch.device("cuda", 0)
    assert router_device("cuda") == torch.device("cuda", 0)
    assert router_device("cuda:1") == torch.device("cuda", 1)
    assert router_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match=r"sees 2 CUDA GPU\(s\), cuda:0 \.\. cuda:1"):
        router_device("cuda:2")


def test_without_a_gpu_auto_is_the_cpu_and_cuda_an_error(monkeypatch):
    _gpus(monkeypatch, 0)
    assert router_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match="sees no CUDA GPU .*use cpu or auto"):
        router_device("cuda")


def test_up_on_a_gpu_that_is_not_there_fails_before_anything_starts(monkeypatch, capsys, tmp_path):
    """One line, exit 2, and nothing read or started: the device is checked before the checkpoint and the groups."""
    from expertmesh.platform import data_plane

    def checkpoint(*_):
        raise AssertionError("the checkpoint was read before the device was checked")

    _gpus(monkeypatch, 0)
    monkeypatch.setattr(data_plane, "Checkpoint", checkpoint)
    code = main(["up", "--router-device", "cuda:0", "--state-url", "memory://"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("expertmesh up: error: router_device cuda:0: this process sees no CUDA GPU"), err


def test_a_gpu_plan_on_a_gpu_cluster_asks_each_group_for_its_gpus_island_and_numa_node(monkeypatch, tmp_path):
    """The specs ``up --gpu-placement`` deploys on a cluster with GPUs (only Ray's resource query and
    the deploy itself faked): each group its GPUs and its island's token, not one GPU each."""
    import json

    import yaml

    from expertmesh.config.settings import DataPlaneConfig
    from expertmesh.models.checkpoint import Checkpoint
    from expertmesh.models.tiny import make_tiny_checkpoint
    from expertmesh.platform import data_plane
    from expertmesh.store import open_store

    model = make_tiny_checkpoint("mixtral", tmp_path / "m")
    island = {"name": "a", "numa": 1, "gpus": [{"id": 0, "memory_gb": 80}, {"id": 1, "memory_gb": 80}]}
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump({"nodes": [{"name": "n0", "islands": [island]}]}))
    experts = [{"expert": e, "replicas": [{"gpu": e % 2, "share": 1.0}]} for e in range(4)]
    (tmp_path / "p.json").write_text(json.dumps({"layers": [{"layer": r, "experts": experts} for r in range(2)]}))
    config = DataPlaneConfig(
        model=model, gpu_placement=tmp_path / "p.json", topology=tmp_path / "topo.yaml", group_per="island"
    )
    checkpoint = Checkpoint(model)
    placement, layout = data_plane._group_map(config, checkpoint.spec)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 2.0, "expertmesh.io/island-a": 1.0})
    deployed = []
    monkeypatch.setattr(
        deployment, "deploy", lambda specs, versions=None: deployed.extend(specs) or {s.name: "h:1" for s in specs}
    )
    data_plane._deploy_groups(config, checkpoint, placement, layout, open_store("memory://"))
    (spec,) = deployed
    assert (spec.name, spec.num_gpus, spec.resources, spec.numa) == ("n0-a", 2, {"expertmesh.io/island-a": 1}, 1)
    assert spec.budget_bytes == layout.hardware["n0-a"].expert_budget_bytes  # the GPU plan's memory, less overhead
