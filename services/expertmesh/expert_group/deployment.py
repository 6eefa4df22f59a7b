"""Expert groups as Ray Serve deployments.

One application, ``expertmesh-groups``, holds one deployment per group
(``group-<name>``, one replica each: a second copy of an expert is a second
group in the routing table, not a second Serve replica) and a small ingress,
``directory``, that reports each group's gRPC address. Each replica loads its
experts and starts an ``ExpertGroup`` gRPC server on an ephemeral port; the
router dials those servers directly, so the data path skips Serve's proxy.

``num_gpus`` is requested only when the Ray cluster has GPUs; each group then
computes on its GPU, otherwise on CPU.

Two ways in: ``deploy(specs)`` from a driver (``expertmesh up``, ``verify``),
which collects the addresses through the directory; and ``build_app(args)``, the
Serve application builder a KubeRay RayService names in ``serveConfigV2``
(``import_path: expertmesh.expert_group.deployment:build_app``). There each
replica listens on ``port_base + i`` (group ``i`` in name order, so
NetworkPolicies can name the ports) and registers its address in the shared
state store itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

log = logging.getLogger(__name__)

APP_NAME = "expertmesh-groups"


@dataclass(frozen=True)
class GroupSpec:
    name: str
    model_path: str
    pairs: tuple[tuple[int, int], ...]
    dtype: str = "float32"
    #: address the gRPC server binds; 0.0.0.0 advertises the node's IP instead
    host: str = "127.0.0.1"
    num_cpus: float = 0.25
    num_gpus: float = 0
    port: int = 0  # 0: any free port
    #: Ray custom resources the replica needs, e.g. {"expertmesh.io/island-nvl-0": 1}
    resources: dict[str, float] = field(default_factory=dict)
    #: shared state store the replica registers its address in; None when the driver collects addresses
    state_url: str | None = None
    #: NUMA node whose CPUs the replica pins itself to (its GPUs' node)
    numa: int | None = None
    #: OTEL_* settings of the process that deployed the group, so its traces join the router's
    telemetry_env: dict[str, str] = field(default_factory=dict)
    #: most bytes of expert weights the group holds; LoadExperts past it is refused. None: unlimited
    budget_bytes: int | None = None


class ExpertGroupReplica:
    def __init__(self, spec: GroupSpec):
        import ray
        import torch

        from expertmesh.checkpoint import Checkpoint
        from expertmesh.expert_group.hosted import HostedExperts
        from expertmesh.expert_group.service import start_server

        if spec.numa is not None:
            pin_to_numa_node(spec.numa)
        import os

        from expertmesh.telemetry import setup as setup_telemetry

        os.environ.update(spec.telemetry_env)
        self._telemetry = setup_telemetry("expertmesh-expert-group")
        # Intra-op threads follow the CPU share: oversubscribing a small host costs more than it gains.
        torch.set_num_threads(max(1, int(spec.num_cpus)))
        device = "cuda" if spec.num_gpus and torch.cuda.is_available() else "cpu"
        self._hosted = HostedExperts(Checkpoint(spec.model_path), getattr(torch, spec.dtype), device, spec.budget_bytes)
        self._hosted.load(list(spec.pairs))
        self._server, port = start_server(spec.name, self._hosted, host=spec.host, port=spec.port)
        advertised = ray.util.get_node_ip_address() if spec.host in ("0.0.0.0", "::") else spec.host
        self._address = f"{advertised}:{port}"
        if spec.state_url:
            from expertmesh.state import open_store

            store = open_store(spec.state_url)
            store.set_endpoint(spec.name, self._address)
            store.close()
        log.info("expert group %s: %d experts on %s, serving %s", spec.name, len(spec.pairs), device, self._address)

    def address(self) -> str:
        return self._address

    def __del__(self):
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop()
        telemetry = getattr(self, "_telemetry", None)
        if telemetry is not None:
            telemetry.shutdown()


class GroupDirectory:
    """Ingress of the groups application: group name -> gRPC address."""

    def __init__(self, **groups):
        self._groups = groups

    async def addresses(self) -> dict[str, str]:
        return {name: await handle.address.remote() for name, handle in self._groups.items()}


def actor_options(spec: GroupSpec) -> dict:
    options: dict = {"num_cpus": spec.num_cpus}
    if spec.num_gpus:
        options["num_gpus"] = spec.num_gpus
    if spec.resources:
        options["resources"] = dict(spec.resources)
    return options


def island_resource(island: str) -> str:
    """The Ray custom resource a node declares for each NVLink island it has (the Helm chart sets it)."""
    return f"expertmesh.io/island-{island}"


def hardware_binding(hardware, has_gpus: bool) -> dict:
    """GroupSpec fields for a group's GPUs: on a GPU cluster its GPU count, its island's
    resource when the cluster declares it, and NUMA pinning; on CPU a logical group."""
    import ray

    if not has_gpus:
        return {}
    resource = island_resource(hardware.island)
    declared = resource in ray.cluster_resources()
    return {
        "num_gpus": len(hardware.gpu_ids),
        "resources": {resource: 1} if declared else {},
        "numa": hardware.numa,
    }


def parse_cpulist(text: str) -> list[int]:
    """Linux cpulist format ("0-3,8,10-11") -> CPU ids."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def pin_to_numa_node(numa: int, sysfs: str = "/sys/devices/system/node") -> list[int]:
    """Pin this process to the CPUs of NUMA node ``numa``; returns them ([] when the node is unknown here)."""
    import os

    try:
        with open(f"{sysfs}/node{numa}/cpulist") as f:
            cpus = parse_cpulist(f.read())
    except OSError:
        log.warning("NUMA node %d is not known on this host; not pinning CPUs", numa)
        return []
    os.sched_setaffinity(0, cpus)
    return cpus


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def application(specs: list[GroupSpec]):
    """The Serve application: one deployment per group behind the directory ingress."""
    groups = {
        spec.name: serve.deployment(ExpertGroupReplica)
        .options(name=f"group-{spec.name}", num_replicas=1, ray_actor_options=actor_options(spec))
        .bind(spec)
        for spec in specs
    }
    directory = serve.deployment(GroupDirectory).options(name="directory", ray_actor_options={"num_cpus": 0})
    return directory.bind(**groups)


def deploy(specs: list[GroupSpec]) -> dict[str, str]:
    """Deploy (or update) every group; blocks until all serve. Returns group -> gRPC address."""
    serve.start(proxy_location="Disabled")
    handle = serve.run(application(specs), name=APP_NAME, route_prefix=None, logging_config={"log_level": "WARNING"})
    return handle.addresses.remote().result()


class GroupsAppArgs(BaseModel):
    """``args`` of the groups application in a RayService's ``serveConfigV2``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="checkpoint directory inside the Ray worker containers")
    placement: dict[str, Any] = Field(description="placement, as in a placement YAML: {groups: {name: {layer: [experts]}}}")
    dtype: str = "float32"
    state_url: str = Field(description="shared state store (redis://...) the groups register their addresses in")
    host: str = "0.0.0.0"
    port_base: int = Field(50100, ge=1, le=65000, description="group i (in name order) listens on port_base + i")
    num_cpus: float = 1.0
    num_gpus: float = 0
    #: group name -> Ray custom resources (e.g. its NVLink island)
    resources: dict[str, dict[str, float]] = Field(default_factory=dict)
    budget_bytes: int | None = Field(None, ge=1, description="bytes of expert weights each group may hold; unset: unlimited")


def build_app(args: dict):
    """Serve application builder for RayService: validates everything before any replica starts."""
    from expertmesh import placement as placement_mod
    from expertmesh.checkpoint import Checkpoint

    config = GroupsAppArgs.model_validate(args)
    spec = Checkpoint(config.model).spec
    placement = placement_mod.parse(config.placement, spec)
    placement_mod.validate(placement, spec)
    unknown = sorted(set(config.resources) - set(placement.groups))
    if unknown:
        raise ValueError(f"resources name groups that the placement does not have: {unknown}")
    return application(
        [
            GroupSpec(
                name=name,
                model_path=config.model,
                pairs=placement.groups[name],
                dtype=config.dtype,
                host=config.host,
                num_cpus=config.num_cpus,
                num_gpus=config.num_gpus,
                port=config.port_base + i,
                resources=config.resources.get(name, {}),
                state_url=config.state_url,
                budget_bytes=config.budget_bytes,
            )
            for i, name in enumerate(sorted(placement.groups))
        ]
    )


def current_addresses() -> dict[str, str]:
    """Group -> gRPC address as the running replicas report it (waits for a restarting one)."""
    return serve.get_app_handle(APP_NAME).addresses.remote().result(timeout_s=120)


def undeploy() -> None:
    serve.delete(APP_NAME)
