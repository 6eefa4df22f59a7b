"""One expert group running in this process, however the process was started.

``RunningGroup`` is what a group process does: pin to its NUMA node, take over
its deployer's environment, load its experts, serve every Dispatch path
(``service.GroupServer``) and keep its address registered in the state store.
The Ray Serve replica (``deployment``) and the plain process of ``expertmesh
group serve`` (``serve_cli``: a Kubernetes Deployment without KubeRay, or the GPU
benchmark, where Ray is not installed) are both this, so neither imports the
other's machinery: nothing here needs Ray.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Callable

#: What ``expertmesh group serve`` prints once its group serves; whoever starts one (``platform.group_processes``,
#: the chaos hosts) waits for this line and reads the name, address and pid from it.
BANNER = re.compile(r"expertmesh group (\S+) is serving \d+ experts on (\S+) \(pid (\d+)\)")


def serving_line(name: str, experts: int, address: str) -> str:
    """The line ``BANNER`` matches, for the group serving in this process."""
    return f"expertmesh group {name} is serving {experts} experts on {address} (pid {os.getpid()})"


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupSpec:
    name: str
    model_path: str
    pairs: tuple[tuple[int, int], ...]
    dtype: str = "float32"
    #: address the gRPC server binds; 0.0.0.0 advertises the node's IP instead
    host: str = "127.0.0.1"
    #: CPUs the group may use: Ray's reservation, and the group's torch intra-op threads
    num_cpus: float = 0.25
    num_gpus: float = 0
    port: int = 0  # 0: any free port
    #: Ray custom resources the replica needs, e.g. {"expertmesh.io/island-nvl-0": 1}
    resources: dict[str, float] = field(default_factory=dict)
    #: shared state store the replica registers its address in; None when the driver collects addresses
    state_url: str | None = None
    #: the deployment whose keys it registers under (None: EXPERTMESH_DEPLOYMENT, else "default")
    deployment: str | None = None
    #: NUMA node whose CPUs the replica pins itself to (its GPUs' node)
    numa: int | None = None
    #: environment the replica takes over from the process that deployed it: OTEL_* (so its traces
    #: join the router's) and EXPERTMESH_TLS_* / EXPERTMESH_ADMIN_* (so it serves as the router dials)
    inherited_env: dict[str, str] = field(default_factory=dict)
    #: most bytes of expert weights the group holds; LoadExperts past it is refused. None: unlimited
    budget_bytes: int | None = None
    #: a stored routing table of a later version than this says what the group loads when it starts: a replica
    #: restarted after live moves takes back what they gave it, not ``pairs``. The deployer sets it to the
    #: store's version before its own first table; None: any stored table of the model that lists the group
    table_after: int | None = None
    #: run one compute per held layer at a decode and a prefill size before serving (``HostedExperts.warm_up``)
    warm_up: bool = True


def start_pairs(spec: GroupSpec, table, model) -> tuple[tuple[int, int], ...]:
    """What ``spec``'s group loads when it starts, given the stored routing table (None: none) and the
    checkpoint's ``ModelIdentity``: the pairs the table lists the group serving, when the table fits this
    model (``RoutingTable.misfits``), is newer than ``spec.table_after`` and lists the group; else
    ``spec.pairs``.

    Serve and Kubernetes restart a replica with the arguments it was first started with, so without this a
    group that gained an expert in a live move comes back without it (and with any it gave away) while the
    table routers serve still lists it: every token routed there fails over or fails."""
    if table is None or (spec.table_after is not None and table.version <= spec.table_after):
        return spec.pairs
    if table.misfits(model.moe_layers, model):
        return spec.pairs
    listed = table.placement().groups.get(spec.name, ())
    return spec.pairs if not listed or set(listed) == set(spec.pairs) else listed


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
    try:
        with open(f"{sysfs}/node{numa}/cpulist") as f:
            cpus = parse_cpulist(f.read())
    except OSError:
        log.warning("NUMA node %d is not known on this host; not pinning CPUs", numa)
        return []
    os.sched_setaffinity(0, cpus)
    return cpus


def node_ip() -> str:
    """This host's address as other hosts reach it: the source address of its default route
    (no packet is sent), else the address its name resolves to, else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routing decides the source, nothing is sent
            return probe.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


class RunningGroup:
    """``spec``'s group serving in this process; ``address`` is what routers dial. ``advertise``
    gives the address to advertise when the server binds every interface (0.0.0.0 or ::). ``in_router``:
    this process is the router's (``up --groups-as in-process``): its CPUs, environment, torch threads and
    telemetry are the router's, and the group takes none of them over."""

    def __init__(self, spec: GroupSpec, advertise: Callable[[], str] = node_ip, *, in_router: bool = False):
        import torch

        from expertmesh.expert_group.service import start_server
        from expertmesh.infra.cpu_threads import group_threads
        from expertmesh.infra.telemetry import setup as setup_telemetry
        from expertmesh.models.checkpoint import Checkpoint
        from expertmesh.models.hosted_experts import HostedExperts

        self._telemetry = None
        if not in_router:
            if spec.numa is not None:
                pin_to_numa_node(spec.numa)
            os.environ.update(spec.inherited_env)
            self._telemetry = setup_telemetry("expertmesh-expert-group")
            # Intra-op threads follow the CPU share: oversubscribing a small host costs more than it gains.
            torch.set_num_threads(group_threads(spec.num_cpus))
        self._registration = None
        self.server = None
        self.device = "cuda" if spec.num_gpus and torch.cuda.is_available() else "cpu"
        store = None
        try:
            from expertmesh.contracts.routing_table import ModelIdentity

            checkpoint = Checkpoint(spec.model_path)
            model = ModelIdentity.of(checkpoint.spec)
            pairs = spec.pairs
            if spec.state_url:
                from expertmesh.contracts.errors import ForeignCheckpoint
                from expertmesh.expert_group.registration import foreign_model
                from expertmesh.store import open_store

                store = open_store(spec.state_url, spec.deployment)
                table = store.routing_table()
                refusal = foreign_model(spec.name, model, table)  # before its experts load, not after
                if refusal is not None:
                    raise ForeignCheckpoint(refusal)
                pairs = start_pairs(spec, table, model)
                if pairs != spec.pairs:
                    log.info(
                        "expert group %s: loading the %d experts the routing table lists it with, not the %d it "
                        "was first started with",
                        spec.name,
                        len(pairs),
                        len(spec.pairs),
                    )
            self.hosted = HostedExperts(checkpoint, getattr(torch, spec.dtype), self.device, spec.budget_bytes)
            self.hosted.load(list(pairs))
            self.pairs = pairs
            #: seconds the warm-up took (None: off); it runs before the server listens, so nothing is served cold
            self.warm_up_s = self.hosted.warm_up() if spec.warm_up else None
            if self.warm_up_s is not None:
                layers = len({layer for layer, _ in pairs})
                log.info("expert group %s: warm-up of its %d layers took %.3fs", spec.name, layers, self.warm_up_s)
            self.server, port = start_server(
                spec.name, self.hosted, host=spec.host, port=spec.port, warm_up_s=self.warm_up_s
            )
            self.address = f"{advertise() if spec.host in ('0.0.0.0', '::') else spec.host}:{port}"
            if store is not None:
                from expertmesh.expert_group.registration import EndpointRegistration

                self._registration = EndpointRegistration(store, spec.name, self.address, model=model).start()
        except BaseException:
            if store is not None and self._registration is None:
                store.close()
            self.stop()
            raise
        log.info("expert group %s: %d experts on %s, serving %s", spec.name, len(pairs), self.device, self.address)

    def stop(self) -> None:
        if self._registration is not None:
            self._registration.stop()
            self._registration = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._telemetry is not None:
            self._telemetry.shutdown()
