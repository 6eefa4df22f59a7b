"""Expert groups on Ray Serve as the orchestrator's launcher (``orchestrator.elastic``): ``expertmesh up
--orchestrator`` with its default ``--groups-as ray``. ``RayGroups.start`` adds a new, empty group to the
data plane's groups application (``expert_group.deployment.GroupsApp``: the same replica code, resources and
placement the platform's own groups get; every other group keeps its replica), ``stop`` takes one out of it
(Serve stops its replica, whose gRPC server drains). ``placement_refusal`` is the pure check of what Ray
cannot place, over the cluster's nodes and free resources.

Example: ``placement_refusal([RayNode("n1", "10.0.0.1", "w1", {"CPU": 8})], {"CPU": 8}, gpus=1,
island="", node="", num_cpus=0.25)`` -> ``"--gpus 1: the Ray cluster has no GPUs; ..."``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from expertmesh.contracts.errors import GroupChangeRefused, GroupSpecRefused, GroupUnavailable
from expertmesh.contracts.topology import ISLAND_RESOURCE_PREFIX, island_resource

if TYPE_CHECKING:
    from expertmesh.platform.data_plane import DataPlane

log = logging.getLogger(__name__)

__all__ = ["RayGroups", "RayNode", "placement_refusal", "room_shortfall"]

#: the share of a node's own ``node:<ip>`` resource a group pinned to that node asks for
NODE_SHARE = 0.001


@dataclass(frozen=True)
class RayNode:
    """One alive node of the Ray cluster: its ID, IP, host name and total resources."""

    id: str
    ip: str
    host: str
    resources: Mapping[str, float]


def _fmt(n: float) -> str:
    return f"{n:g}"


def placement_refusal(
    nodes: Sequence[RayNode],
    free: Mapping[str, float],
    *,
    gpus: int,
    island: str,
    node: str,
    num_cpus: float,
    need_room_now: bool = True,
) -> str | None:
    """Why Ray cannot place a group of ``gpus`` GPUs and ``num_cpus`` CPUs (on NVLink island ``island``, on
    node ``node`` — an ID, IP or host name that one node has; empty: anywhere) given the cluster's ``nodes``
    and its ``free`` resources now (``need_room_now``; else only what no change of the free resources can fix);
    None when it can. One line a person can act on."""
    where = nodes
    if node:
        where = [n for n in nodes if node in (n.id, n.ip, n.host)]
        if not where:
            names = ", ".join(sorted(f"{n.host} at {n.ip}" if n.host else n.ip for n in nodes)) or "none"
            return f"--node {node}: no alive node of the Ray cluster has that ID, IP or host name (its nodes: {names})"
        if len(where) > 1:  # a host name that several nodes share (containers, network namespaces): not one node
            ips = ", ".join(sorted(n.ip for n in where))
            return f"--node {node}: {len(where)} Ray nodes have that host name (at {ips}); name one by its IP"
    if gpus and not any(n.resources.get("GPU", 0) for n in nodes):
        return f"--gpus {gpus}: the Ray cluster has no GPUs; leave --gpus out to compute on CPU"
    resource = island_resource(island)
    if island:
        declared = sorted(
            {
                k.removeprefix(ISLAND_RESOURCE_PREFIX)
                for n in nodes
                for k in n.resources
                if k.startswith(ISLAND_RESOURCE_PREFIX)
            }
        )
        if island not in declared:
            return (
                f"--island {island}: no node of the Ray cluster declares it (resource {resource}; "
                f"its islands: {', '.join(declared) or 'none declared'})"
            )
        where = [n for n in where if resource in n.resources]
        if not where:
            return f"--island {island} --node {node}: that node is not on island {island}"
    fits = [n for n in where if n.resources.get("GPU", 0) >= gpus and n.resources.get("CPU", 0) >= num_cpus]
    if not fits:
        on = "".join((f" on island {island}" if island else "", f" named {node}" if node else ""))
        most = max((n.resources.get("GPU", 0) for n in where), default=0)
        return (
            f"no Ray node{on} has {gpus} GPU(s) and {_fmt(num_cpus)} CPU(s) for the group "
            f"(the most GPUs on one: {_fmt(most)})"
        )
    short = room_shortfall(nodes, free, gpus=gpus, island=island, num_cpus=num_cpus) if need_room_now else None
    if short is not None:
        return (
            f"{short}: remove a group first (`expertmesh groups remove NAME`), or let the platform wait for room "
            "(`up --group-wait-for-room-s`)"
        )
    return None


def room_shortfall(
    nodes: Sequence[RayNode], free: Mapping[str, float], *, gpus: int, island: str, num_cpus: float
) -> str | None:
    """What the cluster lacks free NOW for a group of ``gpus`` GPUs and ``num_cpus`` CPUs (on island ``island``),
    one line; None when it has room. A shortfall, unlike ``placement_refusal``'s other reasons, is one that a
    node added (the Ray autoscaler) or a group removed can end."""
    resource = island_resource(island)
    for name, need in (("GPU", gpus), ("CPU", num_cpus), *(((resource, 1),) if island else ())):
        if need and free.get(name, 0) < need:
            total = sum(n.resources.get(name, 0) for n in nodes)
            what = f"island {island}'s slots ({resource})" if name == resource else f"{name}s"
            return (
                f"the Ray cluster has {_fmt(free.get(name, 0))} of its {_fmt(total)} {what} free and the group "
                f"needs {_fmt(need)}"
            )
    return None


class RayGroups:
    """The expert groups of ``plane`` (started by ``DataPlane.start``) as the launcher the orchestrator adds
    and removes groups through (``running``, ``check``, ``start``, ``stop``), as ``ProcessGroups`` is for
    group processes: any group of the platform can be stopped, the first ones too."""

    def __init__(self, plane: DataPlane):
        if plane.groups_app is None:
            raise ValueError("the data plane runs no groups of its own (attached): nothing to launch through")
        self._plane = plane
        self._app = plane.groups_app
        self._lock = threading.Lock()

    def running(self) -> dict[str, tuple[str, int]]:
        return self._app.replicas()

    def _binding(self, gpus: int, island: str, node: str) -> tuple[dict, GroupChangeRefused | None, str | None]:
        """The new group's GroupSpec hardware fields, why Ray cannot place them (None: it can; GroupSpecRefused:
        never, whatever the free resources), and what the cluster lacks free now (None: nothing), which the platform
        may wait out (``group_wait_for_room_s``)."""
        from expertmesh.expert_group import deployment

        nodes = [RayNode(n["id"], n["ip"], n["host"], n["resources"]) for n in deployment.cluster_nodes()]
        has_gpus = any(n.resources.get("GPU", 0) for n in nodes)
        # 0: as the platform's groups run (one GPU each where the cluster has them)
        num_gpus = gpus or (1 if has_gpus else 0)
        num_cpus = self._plane.config.group_num_cpus
        free = deployment.free_resources()
        waits = self._plane.config.group_wait_for_room_s > 0
        placed = {"gpus": num_gpus, "island": island, "node": node, "num_cpus": num_cpus}
        lasting = placement_refusal(nodes, free, **placed, need_room_now=False)
        now = None if lasting is not None or waits else placement_refusal(nodes, free, **placed, need_room_now=True)
        why = GroupSpecRefused(lasting) if lasting is not None else GroupChangeRefused(now) if now is not None else None
        short = room_shortfall(nodes, free, gpus=num_gpus, island=island, num_cpus=num_cpus) if waits else None
        resources: dict[str, float] = {}
        if island:
            resources[island_resource(island)] = 1
        if node and why is None:
            ip = next(n.ip for n in nodes if node in (n.id, n.ip, n.host))
            resources[f"node:{ip}"] = NODE_SHARE
        return {"num_gpus": num_gpus, "resources": resources}, why, short

    def check_stop(self, name: str) -> None:
        """Any group can be stopped here."""

    def check(self, gpus: int = 0, island: str = "", node: str = "") -> None:
        """Refuse what Ray can never place (GroupSpecRefused), and what it has no room for now (GroupChangeRefused)
        unless the platform waits for room."""
        _, why, _ = self._binding(gpus, island, node)
        if why is not None:
            raise why

    def start(self, name: str, gpus: int = 0, island: str = "", node: str = "") -> tuple[str, int]:
        """One more group deployment, empty: the orchestrator fills it by live moves. (address, pid) once it
        serves. Without room now (and ``group_wait_for_room_s`` set) it is deployed all the same: its replica
        waits in Ray's queue, a resource demand the autoscaler sees, for that long at most."""
        from expertmesh.expert_group.deployment import ADD_TIMEOUT_S
        from expertmesh.platform.data_plane import group_spec

        hardware, why, short = self._binding(gpus, island, node)
        if why is not None:
            raise why
        plane = self._plane
        timeout_s = ADD_TIMEOUT_S
        if short is not None:
            timeout_s = max(ADD_TIMEOUT_S, plane.config.group_wait_for_room_s)
            log.warning("expert group %s: %s; deployed anyway, waiting up to %.0f s for room", name, short, timeout_s)
        # a replica Serve restarts later loads what the tables published from now on list it with
        spec = group_spec(plane.config, plane.checkpoint, name, (), plane.store.routing_table_version(), **hardware)
        with self._lock:
            try:
                address, pid = self._app.add(spec, timeout_s=timeout_s)
            except (RuntimeError, TimeoutError) as err:  # Serve's message, or its wait ran out
                waited = f" (no room for it in {timeout_s:.0f} s: {short})" if short is not None else ""
                raise GroupUnavailable(f"expert group {name} did not serve on Ray Serve: {err}{waited}") from None
            plane.addresses[name] = address
        return address, pid

    def stop(self, name: str) -> int:
        """Take group ``name``'s deployment out of the application; 0 once Serve has stopped its replica."""
        with self._lock:
            if name not in self._app.specs:
                raise GroupUnavailable(f"no expert group {name!r} runs on this platform's Ray Serve application")
            try:
                self._app.remove(name)
            except (RuntimeError, TimeoutError) as err:
                raise GroupUnavailable(f"expert group {name} did not stop on Ray Serve: {err}") from None
            self._plane.addresses.pop(name, None)
        return 0
