"""Test hosts on one machine: a network namespace per host, all plugged into one switch, so
traffic between them crosses a real network stack and a host can be cut off or killed whole.

Glossary
--------
bed
    One run's set of hosts: a *switch* namespace holding a Linux bridge, and one namespace per
    host joined to it by a veth pair (``eth0`` inside the host, ``p<i>`` on the bridge). Every
    name carries the run's id, so two runs (or two engineers) never collide; the root namespace
    gets no interface and no address, and nothing outside the bed is ever dialled.
host
    A namespace with ``lo`` up and one address in the bed's private /24. Commands run in it with
    ``ip netns exec`` (``TestHosts.command``), and see the host's own directory as their
    ``TMPDIR``: a host of its own has a temporary directory of its own, the same for every command
    on it (a Ray node's session files and sockets, which drivers on that node dial) and hidden from
    every other host, so the unix sockets an expert group offers to routers on its host are not
    found by a router on another one, and gRPC over TCP (the cross-host path) is what runs between
    them, not shared memory.
link down
    The host's switch port taken down (``ip -n SWITCH link set p<i> down``): a pulled cable. The
    host keeps its address and its processes; packets to and from it are dropped, connections
    hang rather than being refused, until the port comes up again.

``plan`` (names and addresses, pure) is apart from ``TestHosts`` (the side effects), and
``close`` deletes every namespace the bed made, also after a failure half-way through ``open``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from expertmesh.bench.report import BenchError

__all__ = ["BedPlan", "HostPlan", "TestHosts", "check_can_create", "established", "plan"]

#: Linux's interface names are at most 15 characters (IFNAMSIZ - 1)
IFNAME_MAX = 15
#: the host side of every veth: the same name in each host, which is its own namespace
HOST_IFACE = "eth0"
BRIDGE = "br0"


@dataclass(frozen=True)
class HostPlan:
    name: str
    #: the network namespace
    netns: str
    #: this host's veth end on the switch (in the switch namespace)
    port: str
    #: its address, e.g. "10.77.3.2"
    address: str


@dataclass(frozen=True)
class BedPlan:
    run_id: str
    switch: str
    #: e.g. "10.77.3.0/24"
    subnet: str
    hosts: tuple[HostPlan, ...]

    def host(self, name: str) -> HostPlan:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"the bed has no host {name!r}; its hosts: {', '.join(h.name for h in self.hosts)}")

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "switch": self.switch,
            "subnet": self.subnet,
            "hosts": [vars(h) for h in self.hosts],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "BedPlan":
        return cls(data["run_id"], data["switch"], data["subnet"], tuple(HostPlan(**h) for h in data["hosts"]))


# Counts from a random start so that ids differ across processes that reuse a pid, and never repeat
# within one process (a random suffix alone met the birthday bound: 2 % of 50 ids collided).
_RUN_COUNTER = itertools.count(secrets.randbelow(0x10000))


def new_run_id() -> str:
    """Unique per run on this machine: this process's id and a per-process counter (8 hex digits in
    all). Distinct for 65 536 runs of one process; another process differs by its pid."""
    return f"{os.getpid() & 0xFFFF:04x}{next(_RUN_COUNTER) & 0xFFFF:04x}"


def subnet_for(run_id: str) -> ipaddress.IPv4Network:
    """A private /24 in 10.0.0.0/8 derived from the run id (10.X.Y.0/24, X and Y from its hash), so
    two runs' beds differ even though each lives in namespaces of its own anyway."""
    digest = hashlib.sha256(run_id.encode()).digest()
    return ipaddress.IPv4Network(f"10.{digest[0]}.{digest[1]}.0/24")


def plan(names: list[str], run_id: str | None = None) -> BedPlan:
    """The bed for ``names`` (host names: short words, unique): namespaces ``em<run>-<name>``, switch
    ports ``p<i>``, the i-th host at .(i+2) of the run's /24 (.1 stays unused: no gateway)."""
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"host names must be unique and at least one, got {names}")
    if len(names) > 250:
        raise ValueError(f"a bed's /24 holds at most 250 hosts, got {len(names)}")
    run_id = run_id or new_run_id()
    subnet = subnet_for(run_id)
    hosts = []
    for i, name in enumerate(names):
        if not name.isidentifier() or len(name) > 16:
            raise ValueError(f"host name {name!r}: a short word of letters, digits and _ please")
        port = f"p{i}"
        assert len(port) <= IFNAME_MAX
        hosts.append(HostPlan(name, f"em{run_id}-{name}", port, str(subnet.network_address + i + 2)))
    return BedPlan(run_id, f"em{run_id}-switch", str(subnet), tuple(hosts))


def check_can_create() -> None:
    """BenchError saying what is missing unless this process can make network namespaces."""
    if os.geteuid() != 0:
        raise BenchError("bench chaos --hosts needs root for network namespaces (ip netns add); run it as root")
    if shutil.which("ip") is None:
        raise BenchError("bench chaos --hosts needs iproute2's `ip` on PATH (apt-get install iproute2)")
    probe = f"em{new_run_id()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        raise BenchError(f"bench chaos --hosts cannot create a network namespace here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


class TestHosts:
    """The bed of ``plan``, made by ``open`` (or entering the context) and removed by ``close``.

    A driver inside the bed (another process, ``adopt``) gets the same object without owning it:
    it may run commands in hosts and take links down, never delete the bed.
    """

    __test__ = False  # a fixture, not a pytest class

    def __init__(self, bed: BedPlan, owner: bool = True):
        self.bed = bed
        self._owner = owner
        self._made: list[str] = []
        #: where every host's TMPDIR is: its own directory (``tmpdir``) is mounted over it in that host's commands only
        self._private = Path(tempfile.gettempdir()) / f"em{bed.run_id}-private"
        self._tmpdirs = Path(tempfile.gettempdir()) / f"em{bed.run_id}-hosts"

    @classmethod
    def adopt(cls, bed: BedPlan) -> "TestHosts":
        return cls(bed, owner=False)

    def open(self) -> "TestHosts":
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def _open(self) -> None:
        bed = self.bed
        self._private.mkdir(mode=0o700, exist_ok=True)
        self._tmpdirs.mkdir(mode=0o700, exist_ok=True)
        for h in bed.hosts:
            (self._tmpdirs / h.name).mkdir(mode=0o700, exist_ok=True)
        for netns in (bed.switch, *(h.netns for h in bed.hosts)):
            _ip("netns", "add", netns)
            self._made.append(netns)
        _ip("-n", bed.switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", bed.switch, "link", "set", BRIDGE, "up")
        prefix = ipaddress.IPv4Network(bed.subnet).prefixlen
        for h in bed.hosts:
            # Both ends made inside the bed: no interface ever appears in the root namespace.
            _ip("-n", bed.switch, "link", "add", h.port, "type", "veth", "peer", "name", HOST_IFACE, "netns", h.netns)
            _ip("-n", bed.switch, "link", "set", h.port, "master", BRIDGE)
            _ip("-n", bed.switch, "link", "set", h.port, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/{prefix}", "dev", HOST_IFACE)
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "link", "set", HOST_IFACE, "up")

    def __enter__(self) -> "TestHosts":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def address(self, host: str) -> str:
        return self.bed.host(host).address

    def command(self, host: str, argv: list[str], private_tmp: bool = True) -> list[str]:
        """``argv`` run inside ``host``: its network namespace and, with ``private_tmp``, the host's
        own directory as TMPDIR, bind-mounted over one path that is the same on every host (in the
        mount namespace ``ip netns exec`` makes for the command, so no other host, and not the root
        namespace, sees what is in it there; every command on the host sees the same)."""
        enter = ["ip", "netns", "exec", self.bed.host(host).netns]
        if not private_tmp:
            return [*enter, *argv]
        mount = 'mount --bind "$1" "$0" && shift && TMPDIR="$0" exec "$@"'
        return [*enter, "sh", "-c", mount, str(self._private), str(self.tmpdir(host)), *argv]

    def tmpdir(self, host: str) -> Path:
        """Where ``host``'s TMPDIR is kept, as the root namespace (this process) sees it: to read what
        the host's processes left there (a Ray node's logs)."""
        return self._tmpdirs / self.bed.host(host).name

    def link(self, host: str, up: bool) -> None:
        """The host's switch port up or down (a cable plugged in or pulled)."""
        _ip("-n", self.bed.switch, "link", "set", self.bed.host(host).port, "up" if up else "down")

    def pids(self, host: str) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.bed.host(host).netns], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def kill(self, host: str) -> int:
        """SIGKILL of every process in the host (a host lost whole); how many there were."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def connections(self, host: str) -> list[tuple[str, str]]:
        """The host's established TCP connections (``established``), read from its own /proc/net/tcp{,6}."""
        pairs = []
        for listing in ("/proc/net/tcp", "/proc/net/tcp6"):
            done = subprocess.run(
                ["ip", "netns", "exec", self.bed.host(host).netns, "cat", listing], capture_output=True, text=True
            )
            pairs += established(done.stdout)
        return pairs

    def close(self) -> None:
        """Kill what still runs in the bed and delete its namespaces (the owner only); idempotent."""
        if not self._owner:
            return
        for h in self.bed.hosts:
            if h.netns in self._made:
                self.kill(h.name)
        for netns in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True)
        self._made = []
        shutil.rmtree(self._private, ignore_errors=True)
        shutil.rmtree(self._tmpdirs, ignore_errors=True)


def established(proc_net_tcp: str) -> list[tuple[str, str]]:
    """The established TCP connections in a ``/proc/net/tcp`` or ``/proc/net/tcp6`` listing, as
    ("ip:port" local, "ip:port" remote) pairs. Addresses there are hex, 32-bit words in the host's
    (little-endian) order: 0100007F:1F90 is 127.0.0.1:8080; an IPv4-mapped IPv6 address (gRPC's
    dual-stack sockets) is written as the IPv4 one."""

    def endpoint(field: str) -> str:
        ip, port = field.split(":")
        raw = b"".join(int(ip[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(ip), 8))
        address = ipaddress.ip_address(raw)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return f"{address}:{int(port, 16)}"

    pairs = []
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "01":  # TCP_ESTABLISHED
            pairs.append((endpoint(fields[1]), endpoint(fields[2])))
    return pairs
