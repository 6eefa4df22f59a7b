"""Expert groups as child processes of this one (``expertmesh group serve``), for callers
that want them without Ray: ``expertmesh up --groups-as process``, the benchmarks
(``--groups-as process``) and tests. ``ProcessGroups`` is also the orchestrator's
launcher there (``orchestrator.elastic``): it starts a new group empty and stops one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from expertmesh.contracts.errors import GroupSpecRefused, GroupUnavailable
from expertmesh.expert_group.runtime import BANNER

if TYPE_CHECKING:
    from expertmesh.config.settings import DataPlaneConfig
    from expertmesh.store import StateStore


@dataclass
class GroupProcess:
    name: str
    address: str
    proc: subprocess.Popen
    #: its stderr so far (logs), collected by a thread so the pipe never fills
    stderr: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, then wait (SIGKILL after ``timeout_s``); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def _spawn(name: str, args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "expertmesh.cli.main", "group", "serve", "--group", name, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), name=f"expertmesh-{name}-stderr", daemon=True).start()
    return proc, stderr


def start_groups(names: list[str], args: list[str], env: dict[str, str] | None = None) -> dict[str, GroupProcess]:
    """``expertmesh group serve --group NAME ARGS`` for every name, all starting at once; returns
    once each has printed its banner. One that exits first stops them all and raises with its stderr."""
    env = {**os.environ, **(env or {})}
    spawned = {name: _spawn(name, args, env) for name in names}
    groups: dict[str, GroupProcess] = {}
    try:
        for name, (proc, stderr) in spawned.items():
            banner = proc.stdout.readline()
            match = BANNER.search(banner)
            if match is None:
                proc.wait()
                raise GroupUnavailable(f"expert group {name} did not start: {''.join(stderr)[-2000:] or banner}")
            groups[name] = GroupProcess(name, match.group(2), proc, stderr)
    except BaseException:
        for proc, _ in spawned.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        raise
    return groups


class ProcessGroups:
    """The group processes of one platform, started with the same ``group serve`` arguments; the launcher
    ``orchestrator.elastic`` adds and removes groups through (``running``, ``start``, ``stop``)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, gpu: bool = False):
        self._args = args
        self._env = env
        self._gpu = gpu
        self._lock = threading.Lock()
        self.groups: dict[str, GroupProcess] = {}

    def start_all(self, names: list[str]) -> dict[str, GroupProcess]:
        """The platform's first groups, each with its share of the placement."""
        started = start_groups(names, [*self._args, *(["--gpu"] if self._gpu else [])], self._env)
        with self._lock:
            self.groups.update(started)
        return started

    def running(self) -> dict[str, tuple[str, int]]:
        with self._lock:
            return {n: (g.address, g.proc.pid) for n, g in self.groups.items() if g.proc.poll() is None}

    def check_stop(self, name: str) -> None:
        """Any group can be stopped here."""

    def check(self, gpus: int = 0, island: str = "", node: str = "") -> None:
        """Refuse what a group process on this host can never be (GroupSpecRefused)."""
        check_on_this_host(gpus, island, node, self._gpu, "process")

    def start(self, name: str, gpus: int = 0, island: str = "", node: str = "") -> tuple[str, int]:
        """One more group, empty (``group serve --empty``): the orchestrator fills it by live moves. It starts
        quietly (``--quiet-start``): its imports take only the CPU the serving processes leave idle."""
        self.check(gpus, island, node)
        args = [*self._args, "--empty", "--quiet-start", *(["--gpu"] if gpus or self._gpu else [])]
        group = start_groups([name], args, self._env)[name]
        with self._lock:
            self.groups[name] = group
        return group.address, group.proc.pid

    def stop(self, name: str) -> int:
        with self._lock:
            group = self.groups.pop(name, None)
        if group is None:
            raise GroupUnavailable(f"no group process {name!r} runs here")
        return group.stop()

    def stop_all(self) -> None:
        with self._lock:
            groups, self.groups = self.groups, {}
        for group in groups.values():
            group.stop()


def check_on_this_host(gpus: int, island: str, node: str, gpu: bool, groups_as: str) -> None:
    """Refuse (GroupSpecRefused) what a group ``up --groups-as GROUPS_AS`` starts on this host can never be;
    ``gpu``: the platform's groups compute on this host's GPU already."""
    if island or node:
        raise GroupSpecRefused(
            f"--island and --node place a group on a Ray cluster or Kubernetes; `up --groups-as {groups_as}` runs "
            "its groups on this host: leave them out (or run the groups on Ray)"
        )
    if gpus > 1:
        raise GroupSpecRefused(f"a group here computes on one GPU at most, not {gpus}: use --gpus 1 or 0")
    if gpus and not gpu:
        import torch

        if not torch.cuda.is_available():
            raise GroupSpecRefused("--gpus 1: this host has no CUDA GPU; leave --gpus out to compute on CPU")


def first_placement(config: "DataPlaneConfig"):
    """The model's ``Checkpoint`` and the platform's first ``GroupPlacement``: ``config.placement``'s file, else
    the contiguous split into ``config.groups``, validated."""
    from expertmesh.contracts import group_map as placement_mod
    from expertmesh.models.checkpoint import Checkpoint

    checkpoint = Checkpoint(config.model)
    spec = checkpoint.spec
    if config.placement is not None:
        placement = placement_mod.load(config.placement, spec)
    else:
        placement = placement_mod.contiguous(spec, config.groups)
    placement_mod.validate(placement, spec)
    return checkpoint, placement


def publish_first_table(store: "StateStore", spec, placement, groups) -> None:
    """The started ``groups``' endpoints (``running()``) and their first routing table in ``store``, as
    ``DataPlane.start`` publishes them for Ray Serve groups; the groups are stopped if that fails."""
    from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable

    try:
        for name, (address, _) in groups.running().items():
            store.set_endpoint(name, address)
        table = RoutingTable.from_placement(
            placement, spec.num_experts, version=store.routing_table_version() + 1, model=ModelIdentity.of(spec)
        )
        if not store.publish_routing_table(table):
            raise RuntimeError("another writer changed the routing table while the groups started; retry")
    except BaseException:
        groups.stop_all()
        raise


def start_process_groups(config: "DataPlaneConfig", store: "StateStore") -> ProcessGroups:
    """``config.groups`` ``expertmesh group serve`` processes for the contiguous split of the model's experts,
    their endpoints and first routing table in ``store`` (as ``DataPlane.start`` publishes them for Ray Serve
    groups). With a shared store the groups also register themselves there."""
    from expertmesh.infra.devices import router_device

    checkpoint, placement = first_placement(config)
    args = ["--model", str(config.model), "--dtype", config.dtype]
    args += ["--placement", str(config.placement)] if config.placement is not None else ["--groups", str(config.groups)]
    if not config.state_url.startswith("memory://"):
        args += ["--state-url", config.state_url, "--deployment", store.namespace.removeprefix("expertmesh:")]
    gpu = router_device(config.router_device).type == "cuda"  # the groups compute beside the router, on its GPU
    groups = ProcessGroups(args, gpu=gpu)
    groups.start_all(sorted(placement.groups))
    publish_first_table(store, checkpoint.spec, placement, groups)
    return groups
