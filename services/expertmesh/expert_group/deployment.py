"""Expert groups as Ray Serve deployments.

One application, ``expertmesh-groups``, holds one deployment per group
(``group-<name>``, one replica each: a second copy of an expert is a second
group in the routing table, not a second Serve replica) and a small ingress,
``directory``, that reports each group's gRPC address. Each replica loads its
experts and starts an ``ExpertGroup`` gRPC server on an ephemeral port; the
router dials those servers directly, so the data path skips Serve's proxy.

``num_gpus`` is requested only when the Ray cluster has GPUs; each group then
computes on its GPU, otherwise on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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


class ExpertGroupReplica:
    def __init__(self, spec: GroupSpec):
        import ray
        import torch

        from expertmesh.checkpoint import Checkpoint
        from expertmesh.expert_group.hosted import HostedExperts
        from expertmesh.expert_group.service import start_server

        # Intra-op threads follow the CPU share: oversubscribing a small host costs more than it gains.
        torch.set_num_threads(max(1, int(spec.num_cpus)))
        device = "cuda" if spec.num_gpus and torch.cuda.is_available() else "cpu"
        self._hosted = HostedExperts(Checkpoint(spec.model_path), getattr(torch, spec.dtype), device)
        self._hosted.load(list(spec.pairs))
        self._server, port = start_server(spec.name, self._hosted, host=spec.host)
        advertised = ray.util.get_node_ip_address() if spec.host in ("0.0.0.0", "::") else spec.host
        self._address = f"{advertised}:{port}"
        log.info("expert group %s: %d experts on %s, serving %s", spec.name, len(spec.pairs), device, self._address)

    def address(self) -> str:
        return self._address

    def __del__(self):
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop(grace=2).wait()


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
    return options


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def deploy(specs: list[GroupSpec]) -> dict[str, str]:
    """Deploy (or update) every group; blocks until all serve. Returns group -> gRPC address."""
    serve.start(proxy_location="Disabled")
    groups = {
        spec.name: serve.deployment(ExpertGroupReplica)
        .options(name=f"group-{spec.name}", num_replicas=1, ray_actor_options=actor_options(spec))
        .bind(spec)
        for spec in specs
    }
    directory = serve.deployment(GroupDirectory).options(name="directory", ray_actor_options={"num_cpus": 0})
    handle = serve.run(
        directory.bind(**groups), name=APP_NAME, route_prefix=None, logging_config={"log_level": "WARNING"}
    )
    return handle.addresses.remote().result()


def undeploy() -> None:
    serve.delete(APP_NAME)
