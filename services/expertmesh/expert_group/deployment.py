"""Expert groups as Ray Serve deployments.

One application, ``expertmesh-groups``, holds one deployment per group
(``group-<name>``, one replica each: a second copy of an expert is a second
group in the routing table, not a second Serve replica) and a small ingress,
``directory``, that reports each group's gRPC address. Each replica loads its
experts and starts an ``ExpertGroup`` gRPC server on an ephemeral port
(``runtime.RunningGroup``, the same as ``expertmesh group serve``); the router
dials those servers directly, so the data path skips Serve's proxy.

``num_gpus`` is requested only when the Ray cluster has GPUs; each group then
computes on its GPU, otherwise on CPU.

Two ways in: ``deploy(specs)`` from a driver (``expertmesh up``, ``verify``),
which collects the addresses through the directory (``GroupsApp`` as ``up`` runs it:
then a group added or removed live is a redeploy with one deployment more or less,
each group under a version of its own, so the others keep their replicas); and
``build_app(args)``, the
Serve application builder a KubeRay RayService names in ``serveConfigV2``
(``import_path: expertmesh.expert_group.deployment:build_app``). There each
replica listens on ``port_base + i`` (group ``i`` in name order, so
NetworkPolicies can name the ports) or on its port in ``ports``, and registers its address in the shared
state store itself, again every few seconds (``registration``), so a flushed
store heals without restarts. On Kubernetes every group is an application of its own
(``orchestrator.kube.groups.group_app``): the chart's with only its own experts in ``placement``
(``placement_complete: false``) and its port in ``ports``, one added live with ``empty: [name]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.schema import ApplicationStatus

from expertmesh.contracts.topology import island_resource
from expertmesh.expert_group.runtime import GroupSpec, RunningGroup

# At home in runtime (which needs no Ray); still importable from here.
from expertmesh.infra.console import bar

log = logging.getLogger(__name__)

APP_NAME = "expertmesh-groups"


class ExpertGroupReplica:
    """A Serve replica is one ``RunningGroup``, advertising the Ray node's IP."""

    def __init__(self, spec: GroupSpec):
        import ray

        self._group = RunningGroup(spec, advertise=ray.util.get_node_ip_address)

    def address(self) -> str:
        return self._group.address

    def pid(self) -> int:
        return os.getpid()

    def __del__(self):
        group = getattr(self, "_group", None)
        if group is not None:
            group.stop()


class GroupDirectory:
    """Ingress of the groups application: group name -> gRPC address."""

    def __init__(self, **groups):
        self._groups = groups

    async def addresses(self) -> dict[str, str]:
        return {name: await handle.address.remote() for name, handle in self._groups.items()}

    async def replicas(self) -> dict[str, tuple[str, int]]:
        """group name -> (gRPC address, the replica's pid)"""
        return {
            name: (await handle.address.remote(), await handle.pid.remote()) for name, handle in self._groups.items()
        }


def actor_options(spec: GroupSpec) -> dict:
    options: dict = {"num_cpus": spec.num_cpus}
    if spec.num_gpus:
        options["num_gpus"] = spec.num_gpus
    if spec.resources:
        options["resources"] = dict(spec.resources)
    return options


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


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def cluster_nodes() -> list[dict]:
    """The Ray cluster's alive nodes: ``{"id", "ip", "host", "resources"}`` each (its total resources)."""
    import ray

    return [
        {
            "id": node["NodeID"],
            "ip": node["NodeManagerAddress"],
            "host": node["NodeManagerHostname"],
            "resources": dict(node["Resources"]),
        }
        for node in ray.nodes()
        if node["Alive"]
    ]


def free_resources() -> dict[str, float]:
    """The Ray cluster's resources not reserved by any actor or task now."""
    import ray

    return dict(ray.available_resources())


#: Serve waits this long, then again while Serve-routed calls are in flight, before it stops a replica
#: (default 2 s). The only such calls here are the directory's address lookups; the data path is the
#: group's own gRPC server, which drains itself when the replica stops (``RunningGroup.stop``). So a
#: group stops, restarts or moves 2 s sooner.
SHUTDOWN_WAIT_LOOP_S = 0.1

#: How often Serve's controller pings each group's replica (default 10 s). A replica that died (a
#: SIGKILL, the OOM killer) is noticed only by its next ping, so this is most of the time before Serve
#: starts another: a killed group was 15-27 s away from serving again, now about its start time.
HEALTH_CHECK_PERIOD_S = 1.0


def application(specs: list[GroupSpec], versions: dict[str, str] | None = None):
    """The Serve application: one deployment per group behind the directory ingress. ``versions``: group name
    -> the version its deployment runs under (``GroupsApp``); unset, Serve picks a new one at every deploy
    (which restarts every replica of a redeployed application)."""
    pinned = versions or {}
    groups = {
        spec.name: serve.deployment(ExpertGroupReplica)
        .options(
            name=f"group-{spec.name}",
            num_replicas=1,
            ray_actor_options=actor_options(spec),
            graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            # Serve's public options no longer take a version (it then picks a random one per deploy); its
            # internal flag still passes one, and an unchanged version is what leaves a replica running.
            **({"version": pinned[spec.name], "_internal": True} if spec.name in pinned else {}),
        )
        .bind(spec)
        for spec in specs
    }
    directory = serve.deployment(GroupDirectory).options(
        name="directory", ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S
    )
    return directory.bind(**groups)


#: How often ``deploy`` and ``undeploy`` look at the application's status. Serve's own blocking
#: ``run`` and ``delete`` look once a second: half a second lost on average each way, a good part of a
#: small group's start.
STATUS_POLL_S = 0.05
DEPLOY_TIMEOUT_S = 600.0


def deploy(specs: list[GroupSpec], versions: dict[str, str] | None = None) -> dict[str, str]:
    """Deploy (or update) every group; blocks until all serve. Returns group -> gRPC address."""
    handle = _run(specs, versions)
    _wait_for_app(lambda app: app.status == ApplicationStatus.RUNNING, "start", DEPLOY_TIMEOUT_S)
    return handle.addresses.remote().result()


def _run(specs: list[GroupSpec], versions: dict[str, str] | None):
    """The groups application of ``specs`` handed to Serve (not waited for); the directory's handle."""
    serve.start(proxy_location="Disabled")
    target = serve.RunTarget(
        application(specs, versions), name=APP_NAME, route_prefix=None, logging_config={"log_level": "WARNING"}
    )
    (handle,) = serve.run_many([target], wait_for_applications_running=False)
    return handle


#: seconds a group added live may take to serve (Ray placing it, its worker starting, its warm-up)
ADD_TIMEOUT_S = 300.0
#: seconds a group removed live may take until Serve has stopped its replica and dropped its deployment
REMOVE_TIMEOUT_S = 120.0


class GroupsApp:
    """The groups application as this driver deployed it, changed one group at a time.

    Each group's deployment runs under a version of its own, new at each ``deploy`` (a later ``up`` against
    the same Ray cluster still starts fresh replicas), kept while it runs: redeploying the application with
    one group more (``add``) or less (``remove``) leaves every other group's replica running (only the
    directory, whose arguments change, restarts). Not thread-safe: one change at a time (the orchestrator's
    group controller makes one at a time)."""

    def __init__(self) -> None:
        self.specs: dict[str, GroupSpec] = {}
        self._versions: dict[str, str] = {}

    def deploy(self, specs: list[GroupSpec]) -> dict[str, str]:
        """The platform's first groups (as ``deploy``): group -> gRPC address."""
        versions = {spec.name: uuid.uuid4().hex for spec in specs}
        addresses = deploy(specs, versions)
        self.specs, self._versions = {spec.name: spec for spec in specs}, versions
        return addresses

    def replicas(self) -> dict[str, tuple[str, int]]:
        """group -> (gRPC address, pid) of every group of the application, as its replicas report them."""
        return serve.get_app_handle(APP_NAME).replicas.remote().result(timeout_s=120)

    def add(self, spec: GroupSpec, timeout_s: float = ADD_TIMEOUT_S) -> tuple[str, int]:
        """One more group deployment; returns (address, pid) once it serves. A group that fails or does not
        serve within ``timeout_s`` is taken out again (the others keep running) and raises RuntimeError
        (Serve's message) or TimeoutError."""
        if spec.name in self.specs:
            raise ValueError(f"the groups application has a group {spec.name!r} already")
        specs = [*self.specs.values(), spec]
        versions = {**self._versions, spec.name: uuid.uuid4().hex}
        deployment = f"group-{spec.name}"
        handle = _run(specs, versions)
        try:
            _wait_for_change(
                lambda deployments: deployments.get(deployment) == "HEALTHY", f"serve {spec.name}", timeout_s
            )
        except BaseException:
            _run(list(self.specs.values()), self._versions)  # back to the groups that ran, untouched
            raise
        self.specs, self._versions = {s.name: s for s in specs}, versions
        return handle.replicas.remote().result(timeout_s=120)[spec.name]

    def remove(self, name: str, timeout_s: float = REMOVE_TIMEOUT_S) -> None:
        """Redeploy without group ``name``; returns once Serve has stopped its replica (``RunningGroup.stop``:
        its gRPC server drains) and no longer lists its deployment."""
        if name not in self.specs:
            raise KeyError(name)
        specs = [s for s in self.specs.values() if s.name != name]
        versions = {n: v for n, v in self._versions.items() if n != name}
        _run(specs, versions)
        self.specs, self._versions = {s.name: s for s in specs}, versions  # Serve's target from now on
        deployment = f"group-{name}"
        _wait_for_change(lambda deployments: deployment not in deployments, f"stop {name}", timeout_s)


def _wait_for_change(done, doing: str, timeout_s: float) -> None:
    """After a redeploy: until the application runs again and ``done(deployment name -> status)``."""
    _wait_for_app(lambda app: app.status == ApplicationStatus.RUNNING, doing, timeout_s, deployments_done=done)


class GroupsAppArgs(BaseModel):
    """``args`` of the groups application in a RayService's ``serveConfigV2``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="checkpoint directory inside the Ray worker containers")
    placement: dict[str, Any] | None = Field(
        None,
        description="placement, as in a placement YAML: {groups: {name: {layer: [experts]}}}; every expert hosted. "
        "Unset: only ``empty`` groups (an application of one group added live)",
    )
    placement_complete: bool = Field(
        True,
        description="false: ``placement`` names only this application's groups (the chart renders an application "
        "per group), so only what it names is checked here; every expert hosted is the chart's placement's check",
    )
    empty: list[str] = Field(
        default_factory=list,
        description="groups started holding no experts, not in the placement (added live: the orchestrator fills "
        "them by moves); each needs its port in ``ports``",
    )
    dtype: str = "float32"
    state_url: str = Field(description="shared state store (redis://...) the groups register their addresses in")
    deployment: str = Field(
        "default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", description="the deployment's keys in it"
    )
    host: str = "0.0.0.0"
    port_base: int = Field(
        50100, ge=1, le=65000, description="group i of the placement (in name order) listens on port_base + i"
    )
    #: group name -> its port, over port_base + i: a group added live gets one no other group's shifts
    ports: dict[str, int] = Field(default_factory=dict)
    num_cpus: float = 1.0
    num_gpus: float = 0
    #: group name -> Ray custom resources (e.g. its NVLink island)
    resources: dict[str, dict[str, float]] = Field(default_factory=dict)
    budget_bytes: int | None = Field(
        None, ge=1, description="bytes of expert weights each group may hold; unset: unlimited"
    )
    warm_up: bool = Field(True, description="each group runs its warm-up before it serves (HostedExperts.warm_up)")


def group_version(spec: GroupSpec) -> str:
    """A deployment version derived from everything of ``spec`` its replica is started with: equal specs, equal
    versions, so a redeploy through ``serve.run`` leaves a group whose spec did not change running.

    Under a RayService (Serve's declarative API) Serve versions every deployment of an application by its
    config's hash instead (import path, runtime env, ``args``): there every group is an application of its own
    (``orchestrator.kube.groups``), so one added or removed leaves the others' configs, and replicas, as they
    were."""
    fields = dataclasses.asdict(spec)
    fields["pairs"] = [list(p) for p in spec.pairs]
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def group_specs(config: GroupsAppArgs) -> list[GroupSpec]:
    """The ``GroupSpec`` of every group ``config`` names, checked against the checkpoint (a bad placement, an
    ``empty`` group the placement also has, a port missing or used twice: ValueError / PlacementError)."""
    from expertmesh.contracts import group_map as placement_mod
    from expertmesh.models.checkpoint import Checkpoint

    spec = Checkpoint(config.model).spec
    groups: dict[str, tuple] = {}
    if config.placement is not None:
        placement = placement_mod.parse(config.placement, spec)
        placement_mod.validate(placement, spec, complete=config.placement_complete)
        groups = dict(placement.groups)
    elif not config.empty:
        raise ValueError("the groups application needs a placement or empty groups")
    ports = {name: config.port_base + i for i, name in enumerate(sorted(groups))}
    both = sorted(set(config.empty) & set(groups))
    if both:
        raise ValueError(f"empty names groups that the placement has: {both}")
    groups |= {name: () for name in config.empty}
    unknown = sorted((set(config.resources) | set(config.ports)) - set(groups))
    if unknown:
        raise ValueError(f"resources or ports name groups that the application does not have: {unknown}")
    ports |= config.ports
    unported = sorted(set(groups) - set(ports))
    if unported:
        raise ValueError(f"empty groups need their port in ports: {unported}")
    if len(set(ports.values())) < len(ports):
        raise ValueError(f"two groups on one port: {dict(sorted(ports.items()))}")
    return [
        GroupSpec(
            name=name,
            model_path=config.model,
            pairs=groups[name],
            dtype=config.dtype,
            host=config.host,
            num_cpus=config.num_cpus,
            num_gpus=config.num_gpus,
            port=ports[name],
            resources=config.resources.get(name, {}),
            state_url=config.state_url,
            deployment=config.deployment,
            budget_bytes=config.budget_bytes,
            warm_up=config.warm_up,
        )
        for name in sorted(groups)
    ]


def build_app(args: dict):
    """Serve application builder for RayService: validates everything before any replica starts."""
    specs = group_specs(GroupsAppArgs.model_validate(args))
    return application(specs, {spec.name: group_version(spec) for spec in specs})


def current_addresses() -> dict[str, str]:
    """Group -> gRPC address as the running replicas report it (waits for a restarting one)."""
    return serve.get_app_handle(APP_NAME).addresses.remote().result(timeout_s=120)


def undeploy() -> None:
    serve.delete(APP_NAME, _blocking=False)  # then waited for here, more often than Serve's own wait looks
    _wait_for_app(lambda app: app.status == ApplicationStatus.NOT_STARTED, "stop", 60.0)


def app_status():
    """The groups application's status as Serve's controller keeps it (``StatusOverview``: the app's
    status and message, one ``DeploymentStatusInfo`` per deployment; NOT_STARTED when there is none).

    Not ``serve.status()``: that validates every deployment's config into pydantic models, which
    cloudpickles each one's request-router class, walking ``sys.modules`` per function: 0.13 CPU s a
    call in a process that has imported torch and transformers. Polled while groups start, it took
    more CPU than the replicas being waited for. This is the call Serve's own blocking ``run`` polls."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_status(APP_NAME)


def _wait_for_app(done, doing: str, timeout_s: float, deployments_done=None) -> None:
    """Polls the groups application's status until ``done(status)`` (and ``deployments_done(deployment
    name -> status)``, if given); a failed deployment raises with Serve's message."""
    deadline = time.monotonic() + timeout_s
    while True:
        overview = app_status()
        app = overview.app_status
        if done(app) and (
            deployments_done is None or deployments_done({d.name: d.status for d in overview.deployment_statuses})
        ):
            return
        if app.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"Deploying application {APP_NAME} failed: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the expert groups did not {doing} within {timeout_s:.0f}s (Serve status: {app.status.value})"
            )
        time.sleep(STATUS_POLL_S)


@contextmanager
def groups_loading(total: int, poll_s: float = 0.5) -> Iterator[None]:
    """While the body deploys ``total`` expert groups on Ray Serve: a bar of the groups that serve
    (their replicas have loaded their weights), from Serve's status. Nothing runs when no bar shows."""
    shown = bar(total, "expert groups loaded", unit="group")
    if shown.disable:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            try:
                deployments = app_status().deployment_statuses
            except Exception:  # Serve not up yet, or going down: the bar just waits
                continue
            healthy = sum(d.status == "HEALTHY" for d in deployments if d.name.startswith("group-"))
            shown.update(healthy - shown.n)

    watcher = threading.Thread(target=watch, name="expertmesh-groups-bar", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        shown.close()
