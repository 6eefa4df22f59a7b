"""The chaos platform across test hosts (``hosts.TestHosts``): Redis, the orchestrator, the
router and each expert group on a host of its own, with its own address, so every call between
them crosses a network stack and the router reaches the groups by gRPC over TCP, the path it
takes to a group on another machine (a router finds a group's same-host sockets only on its own
host).

The processes are those of ``platform.ChaosPlatform`` (the same orchestrator and router, the
same ring placement) except the groups: plain processes (``expertmesh group serve``), one per
group host, registering their address in the store, as a Kubernetes Deployment without KubeRay
runs them; a killed one is started again by ``restart_group`` at the same address, as its
Deployment would. The driver (this process) must run on the bed's ``client`` host: it dials the
store, the groups, the admin API and the router at their hosts' addresses, and nothing else.

Host names: ``redis``, ``orch``, ``router``, ``client`` and the groups' names (``g0``, ``g1``, ...).
"""

from __future__ import annotations

import os
import secrets

from expertmesh.bench.chaos.hosts import TestHosts
from expertmesh.bench.chaos.platform import ChaosPlatform, Child, PlatformSettings, RedisServer, Wrap
from expertmesh.bench.report import BenchError
from expertmesh.expert_group.runtime import BANNER

__all__ = ["CLIENT", "HostsPlatform", "host_names"]

CLIENT = "client"
#: the host each process of the platform runs on, by its role
ROLE_HOST = {"redis": "redis", "orchestrator": "orch", "router": "router"}
REDIS_PORT = 6379
GROUP_PORT = 50100


def host_names(groups: int) -> list[str]:
    """The bed's hosts for a platform of ``groups`` expert groups."""
    return [*ROLE_HOST.values(), *(f"g{i}" for i in range(groups)), CLIENT]


class HostsPlatform(ChaosPlatform):
    def __init__(self, settings: PlatformSettings, hosts: TestHosts):
        self.hosts = hosts
        missing = sorted(set(host_names(settings.groups)) - {h.name for h in hosts.bed.hosts})
        if missing:
            raise BenchError(f"the test hosts lack {', '.join(missing)} for {settings.groups} groups")
        # Admin calls (the orchestrator's loads and unloads on groups, this driver's moves) come from
        # another host now, and a server without an admin identity accepts them from loopback only:
        # one token for the run, in the environment every process of the platform inherits.
        os.environ.setdefault("EXPERTMESH_ADMIN_TOKEN", secrets.token_hex(16))
        super().__init__(settings)
        #: each group's process, by group
        self.group_children: dict[str, Child] = {}

    def host_of(self, role: str) -> str:
        """The test host of ``role``: "redis", "orchestrator", "router" or a group."""
        return ROLE_HOST.get(role, role)

    def address_of(self, role: str) -> str:
        return self.hosts.address(self.host_of(role))

    def wrap_for(self, role: str) -> Wrap:
        host = self.host_of(role)
        return lambda argv: self.hosts.command(host, argv)

    def _redis_server(self) -> RedisServer:
        return RedisServer(self._workdir, self.address_of("redis"), REDIS_PORT, self.wrap_for("redis"))

    def _start_groups(self) -> None:
        for group in self.groups:
            self.group_children[group] = Child(
                group,
                [
                    "group",
                    "serve",
                    "--group",
                    group,
                    "--model",
                    str(self.checkpoint.path),
                    "--placement",
                    str(self._workdir / "placement.yaml"),
                    "--host",
                    self.address_of(group),
                    "--port",
                    str(GROUP_PORT),
                    "--state-url",
                    self.redis.url,
                ],
                {},
                self.settings.log_dir,
                self.wrap_for(group),
            ).start()
        for group in self.groups:
            self._wait_for_group(group)

    def _wait_for_group(self, group: str, timeout_s: float = 300) -> None:
        self.group_children[group].wait_for(BANNER.pattern, timeout_s)

    def restart_group(self, group: str, timeout_s: float = 300) -> None:
        """Start the group's process again on its host (after the host was killed), until it serves."""
        self.group_children[group].start()
        self._wait_for_group(group, timeout_s)

    def close(self) -> None:
        try:
            super().close()
        finally:
            for child in self.group_children.values():
                child.stop()
