"""Expert groups in the router's own process: ``expertmesh up --groups-as in-process`` and the benchmarks'
``--groups-as in-process``, for one host of a few cores.

Each is a whole group (``expert_group.runtime.RunningGroup``): its experts, its gRPC server (the
orchestrator loads and unloads through it, other routers and ``expertmesh`` commands reach it there), its
same-host paths, its registration in a shared store. Only this router's calls differ: the ``auto``
transport finds the group in this process by the token its server drew (``lookup``) and calls it in place
(``router.transport.in_process``), so a MoE layer's call is a function call on the router's thread and its
torch threads, not a frame to another process that wakes to compute it. The router's torch threads,
telemetry, environment and CPUs stay the router's (``RunningGroup(in_router=True)``).

``InProcessGroups`` is also the orchestrator's launcher there (``orchestrator.elastic``): it starts a new
group empty and stops one.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from expertmesh.contracts.errors import GroupUnavailable
from expertmesh.expert_group.runtime import GroupSpec, RunningGroup
from expertmesh.platform.group_processes import check_on_this_host, first_placement, publish_first_table

if TYPE_CHECKING:
    from expertmesh.config.settings import DataPlaneConfig
    from expertmesh.expert_group.service import ExpertGroupServicer
    from expertmesh.store import StateStore


class InProcessGroups:
    """The groups one router runs in its process, all of one checkpoint and dtype (``base``: their common
    ``GroupSpec``, whose name and pairs each group replaces)."""

    def __init__(self, base: GroupSpec):
        self._base = base
        self._lock = threading.Lock()
        self.groups: dict[str, RunningGroup] = {}
        #: each running group's servicer by its server's shared-memory token (what ``lookup`` reads)
        self._by_token: dict[bytes, ExpertGroupServicer] = {}

    def lookup(self, token: bytes) -> "ExpertGroupServicer | None":
        """The group of this process whose server drew ``token``; None once it stopped (or for any other)."""
        return self._by_token.get(token)

    def start_all(self, placement: dict[str, tuple[tuple[int, int], ...]]) -> dict[str, RunningGroup]:
        """The platform's first groups, each with its share of the placement (group -> (layer, expert) pairs),
        one after another (each reads its experts and warms up); one that fails stops those started."""
        try:
            for name in sorted(placement):
                self._start(name, tuple(placement[name]))
        except BaseException:
            self.stop_all()
            raise
        return dict(self.groups)

    def _start(self, name: str, pairs: tuple[tuple[int, int], ...]) -> RunningGroup:
        from dataclasses import replace

        group = RunningGroup(replace(self._base, name=name, pairs=pairs), in_router=True)
        with self._lock:
            self.groups[name] = group
            local = group.server.local if group.server is not None else None
            if local is not None:
                self._by_token = {**self._by_token, local.token: group.server.servicer}
        return group

    def running(self) -> dict[str, tuple[str, int]]:
        with self._lock:
            return {name: (group.address, os.getpid()) for name, group in self.groups.items()}

    def check(self, gpus: int = 0, island: str = "", node: str = "") -> None:
        """Refuse what a group in this process can never be (GroupSpecRefused)."""
        check_on_this_host(gpus, island, node, self._base.num_gpus > 0, "in-process")

    def check_stop(self, name: str) -> None:
        """Any group can be stopped here."""

    def start(self, name: str, gpus: int = 0, island: str = "", node: str = "") -> tuple[str, int]:
        """One more group, empty: the orchestrator fills it by live moves."""
        self.check(gpus, island, node)
        if name in self.running():
            raise GroupUnavailable(f"a group {name!r} runs in this process already")
        group = self._start(name, ())
        return group.address, os.getpid()

    def stop(self, name: str) -> int:
        with self._lock:
            group = self.groups.pop(name, None)
            if group is not None:
                self._by_token = {t: s for t, s in self._by_token.items() if s is not group.server.servicer}
        if group is None:
            raise GroupUnavailable(f"no group {name!r} runs in this process")
        group.stop()
        return 0

    def stop_all(self) -> None:
        with self._lock:
            groups, self.groups, self._by_token = self.groups, {}, {}
        for group in groups.values():
            group.stop()


def start_in_process_groups(config: "DataPlaneConfig", store: "StateStore") -> InProcessGroups:
    """``config.groups`` groups in this process for the contiguous split of the model's experts (or
    ``config.placement``'s), their endpoints and first routing table in ``store``. With a shared store the
    groups also register themselves there, as group processes do."""
    from expertmesh.infra.devices import router_device

    checkpoint, placement = first_placement(config)
    shared = not config.state_url.startswith("memory://")
    base = GroupSpec(
        name="",
        model_path=str(checkpoint.path.resolve()),
        pairs=(),
        dtype=config.dtype,
        num_gpus=1 if router_device(config.router_device).type == "cuda" else 0,
        state_url=config.state_url if shared else None,
        deployment=store.namespace.removeprefix("expertmesh:") if shared else None,
        warm_up=config.warm_up,
    )
    groups = InProcessGroups(base)
    groups.start_all(dict(placement.groups))
    publish_first_table(store, checkpoint.spec, placement, groups)
    return groups
