"""The platform under chaos: the Kubernetes shape of a deployment, on this machine, with every
process one that a fault can reach.

- a redis-server of its own (the state store), started here so it can be stopped, restarted
  with its data and flushed;
- the expert groups as the Serve application ``build_app`` builds (what a KubeRay RayService
  runs), on a local Ray started here, each group on a fixed port and registering itself in
  the store; started with ``EXPERTMESH_ENABLE_FAULT_INJECTION=1``, so ``InjectFault`` works;
- ``expertmesh orchestrator --health-monitor`` as its own process (so it can be killed while
  the data plane serves), applying a placement file that lists every expert on two groups;
- ``expertmesh up --router-only``, the router, serving the Inference API from the store.

Why not ``expertmesh up`` with its groups in one process tree: there a restarted group comes
back on a new port, and the groups register nowhere themselves, so a flushed store would lose
their addresses for good; the router-only shape is the one that production runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from expertmesh.bench.report import BenchError
from expertmesh.infra.console import progress
from expertmesh.infra.ports import free_port, free_port_range
from expertmesh.models.checkpoint import Checkpoint, MoESpec
from expertmesh.orchestrator.migration.group_calls import GroupCallFailed, GroupChannels, GroupView
from expertmesh.store import StateStore, open_store


@dataclass(frozen=True)
class PlatformSettings:
    model: Path
    #: expert groups; every expert is on two of them
    groups: int = 3
    #: seconds between the health monitor's rounds
    health_interval_s: float = 5.0
    #: probe hidden states per replica per round
    health_tokens: int = 1000
    #: the router's deadline of one expert-group call (a hung group costs a step this long)
    group_timeout_s: float = 2.0
    #: how often the router reports the table it serves and re-reads quarantines
    heartbeat_s: float = 0.5
    #: keep the router's and the orchestrator's output here (router.log, orchestrator.log)
    log_dir: Path | None = None


def ring_placement(spec: MoESpec, groups: list[str]) -> dict:
    """Placement YAML data: expert e of layer l on groups (e + l) and (e + l + 1) mod n, so every
    expert has a second replica and losing any one group leaves every expert served."""
    placement: dict[str, dict[int, list[int]]] = {g: {} for g in groups}
    for layer in spec.moe_layers:
        for expert in range(spec.num_experts):
            for k in range(min(2, len(groups))):
                placement[groups[(expert + layer + k) % len(groups)]].setdefault(layer, []).append(expert)
    return {"groups": placement}


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (the groups' fixed port base)."""
    try:
        return free_port_range(n)
    except OSError as err:
        raise BenchError(f"{err} for the expert groups") from None


def wait_until(predicate, timeout_s: float, poll_s: float = 0.1) -> float | None:
    """time.monotonic() when ``predicate()`` first held, or None after ``timeout_s``. A predicate
    that cannot reach the store or a group counts as false (it may be down: that is the point)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return time.monotonic()
        except (ConnectionError, GroupCallFailed):
            pass
        if time.monotonic() >= end:
            return None
        time.sleep(poll_s)


#: how a command is run where its process belongs: argv -> the argv to start (e.g. inside a test host)
Wrap = Callable[[list[str]], list[str]]


def _as_is(argv: list[str]) -> list[str]:
    return argv


class RedisServer:
    """A redis-server of the benchmark's own, on a loopback port unless ``host`` (with ``port``)
    says where and ``wrap`` how to start it; ``stop`` saves its data to disk and ``start`` again
    loads it (a restart, not a loss: ``flush`` is the loss)."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1", port: int | None = None, wrap: Wrap = _as_is):
        self._binary = shutil.which("redis-server")
        if self._binary is None:
            raise BenchError("bench chaos needs redis-server on PATH (e.g. apt-get install redis-server)")
        self._dir = workdir
        self.host = host
        self.port = port or free_port()
        self.url = f"redis://{host}:{self.port}/0"
        self._wrap = wrap
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # Off loopback, protected mode refuses every client without a password; the address is one
        # of a test host's (``hosts``), reachable from the test's own hosts only.
        protected = [] if self.host == "127.0.0.1" else ["--protected-mode", "no"]
        self.proc = subprocess.Popen(
            self._wrap(
                [
                    self._binary,
                    "--bind",
                    self.host,
                    "--port",
                    str(self.port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self._dir),
                    "--dbfilename",
                    "chaos.rdb",
                    *protected,
                ]
            ),
            stdout=subprocess.DEVNULL,
        )
        if wait_until(self.ping, 15) is None:
            raise BenchError(f"redis-server on {self.host}:{self.port} did not start")

    def _client(self):
        import redis

        return redis.Redis(host=self.host, port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def ping(self) -> bool:
        with self._client() as client:
            return bool(client.ping())

    def stop(self) -> None:
        """SHUTDOWN SAVE: the data goes to disk and the server exits."""
        import redis

        try:
            with self._client() as client:
                client.shutdown(save=True)
        except redis.ConnectionError:
            pass  # it answers the shutdown by closing the connection
        self.proc.wait(timeout=30)

    def flush(self) -> None:
        with self._client() as client:
            client.flushall()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Child:
    """An ``expertmesh`` command as a child process (started through ``wrap``), its stderr kept for
    ``wait_for`` and reports."""

    def __init__(
        self, name: str, args: list[str], env: dict[str, str], log_dir: Path | None = None, wrap: Wrap = _as_is
    ):
        self.name = name
        self._argv = wrap([sys.executable, "-m", "expertmesh.cli.main", *args])
        self._env = {**os.environ, **env}
        self._log = None if log_dir is None else log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []

    def start(self) -> "Child":
        """Start (again: a restart's output is appended to the same log; ``lines`` start afresh)."""
        self.lines = []
        self.proc = subprocess.Popen(
            self._argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self._env
        )
        threading.Thread(
            target=self._read, args=(self.lines, self.proc.stdout), name=f"chaos-{self.name}-log", daemon=True
        ).start()
        return self

    def _read(self, lines: list[str], stream) -> None:
        with open(self._log, "a") if self._log is not None else contextlib.nullcontext() as log:
            for line in stream:
                lines.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first output line matching ``pattern``; BenchError if the process exits or time runs out."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise BenchError(f"{self.name} did not print {pattern!r}; its last output:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "".join(self.lines[-lines:])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout_s: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


class ChaosPlatform:
    """The processes above, started by ``start`` and all stopped by ``close``."""

    def __init__(self, settings: PlatformSettings):
        self.settings = settings
        self.checkpoint = Checkpoint(settings.model)
        self.spec = self.checkpoint.spec
        if settings.groups < 2:
            raise BenchError("bench chaos needs at least 2 expert groups: every expert gets a second replica")
        if settings.groups > self.spec.num_experts:
            raise BenchError(
                f"--groups {settings.groups} is more than the model's {self.spec.num_experts} experts per layer"
            )
        self.groups = [f"g{i}" for i in range(settings.groups)]
        self.placement = ring_placement(self.spec, self.groups)
        self._workdir = Path(tempfile.mkdtemp(prefix="expertmesh-chaos-"))
        #: the placement file the orchestrator applies (``placement``); a fault may start a group from it too
        self.placement_file = self._workdir / "placement.yaml"
        self.redis = self._redis_server()
        self.store: StateStore | None = None
        self.channels: GroupChannels | None = None
        self.orchestrator: Child | None = None
        self.router: Child | None = None
        self.target = ""
        #: the router's OpenAI-compatible HTTP API (``http://host:port``)
        self.http_url = ""
        self.admin_address = ""
        self._ray_started = False

    def start(self) -> "ChaosPlatform":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        s = self.settings
        if s.log_dir is not None:
            s.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis.start()
        self.store = open_store(self.redis.url)
        self.channels = GroupChannels(self.store.endpoints)
        self.placement_file.write_text(yaml.safe_dump(self.placement))
        progress(
            f"bench chaos: redis-server on {self.redis.host}:{self.redis.port}; "
            f"starting {len(self.groups)} expert groups"
        )
        self._start_groups()
        self.orchestrator = Child(
            "orchestrator",
            [
                "orchestrator",
                "--state-url",
                self.redis.url,
                "--model",
                str(self.checkpoint.path),
                "--placement",
                str(self.placement_file),
                "--admin-host",
                self.address_of("orchestrator"),
                "--admin-port",
                "0",
                "--interval",
                "1",
                "--health-monitor",
                "--no-kube",
            ],
            {
                "EXPERTMESH_HEALTH_INTERVAL_S": str(s.health_interval_s),
                "EXPERTMESH_HEALTH_TOKENS": str(s.health_tokens),
            },
            s.log_dir,
            self.wrap_for("orchestrator"),
        ).start()
        self.wait_for_orchestrator()
        self.router = Child(
            "router",
            [
                "up",
                "--router-only",
                "--model",
                str(self.checkpoint.path),
                "--state-url",
                self.redis.url,
                "--host",
                self.address_of("router"),
                "--port",
                "0",
                "--http-port",
                "0",
                "--max-active",
                "64",
            ],
            {
                "EXPERTMESH_DISPATCH_TIMEOUT_S": str(s.group_timeout_s),
                "EXPERTMESH_HEARTBEAT_S": str(s.heartbeat_s),
                "EXPERTMESH_LOAD_PUBLISH_S": "1",
            },
            s.log_dir,
            self.wrap_for("router"),
        ).start()
        self.target = self.router.wait_for(r"expertmesh is serving \S+ on (\S+:\d+) ", 300).group(1)
        self.http_url = self.router.wait_for(r"OpenAI-compatible HTTP API on (\S+)/v1 ", 60).group(1)
        progress(f"bench chaos: router serving on {self.target}, HTTP on {self.http_url}")

    # Where each process runs: here all on loopback; ``hosts_platform.HostsPlatform`` puts each on a test host.

    def address_of(self, role: str) -> str:
        """The address the process of ``role`` ("router", "orchestrator", a group) binds."""
        return "127.0.0.1"

    def wrap_for(self, role: str) -> Wrap:
        return _as_is

    def _redis_server(self) -> RedisServer:
        return RedisServer(self._workdir)

    def _start_groups(self) -> None:
        import ray
        from ray import serve

        from expertmesh.expert_group.deployment import APP_NAME, build_app

        if ray.is_initialized():
            raise BenchError("bench chaos starts a Ray of its own; this process is already attached to one")
        ray.init(
            address="local",  # a Ray of its own, never one an earlier `ray start` left registered
            include_dashboard=False,
            log_to_driver=False,
            logging_level="WARNING",
            # Every replica, the restarted ones too, accepts the fault hook; nothing else does.
            runtime_env={"env_vars": {"EXPERTMESH_ENABLE_FAULT_INJECTION": "1"}},
        )
        self._ray_started = True
        serve.start(proxy_location="Disabled")
        app = build_app(
            {
                "model": str(self.checkpoint.path),
                "placement": self.placement,
                "state_url": self.redis.url,
                "host": "127.0.0.1",
                "port_base": _free_ports(len(self.groups)),
                "num_cpus": 0.25,
            }
        )
        serve.run(app, name=APP_NAME, route_prefix=None, logging_config={"log_level": "WARNING"})

    def wait_for_orchestrator(self, timeout_s: float = 300) -> None:
        """Until the (re)started orchestrator serves its admin API; it published or adopted the table by then."""
        match = self.orchestrator.wait_for(
            r"orchestrator: routing table version \d+; admin gRPC on (\S+:\d+)", timeout_s
        )
        self.admin_address = match.group(1)

    def start_migration(self, layer: int, expert: int, mode: int, target: str = "", source: str = ""):
        """One live migration started through the orchestrator's admin API (``expertmesh migrate``);
        its first record (``admin_pb2.Migration``), not waited for."""
        from expertmesh.orchestrator import admin_client
        from expertmesh.v1 import admin_pb2 as pb

        channel, stub = admin_client.connect(self.admin_address)
        try:
            request = pb.MigrateRequest(layer=layer, expert=expert, mode=mode, target=target, source=source)
            return admin_client.call(stub.Migrate, request)
        finally:
            channel.close()

    def migration(self, migration_id: str):
        """The migration's record as the admin API has it now."""
        from expertmesh.orchestrator import admin_client
        from expertmesh.v1 import admin_pb2 as pb

        channel, stub = admin_client.connect(self.admin_address)
        try:
            return admin_client.call(stub.GetMigration, pb.GetMigrationRequest(id=migration_id))
        finally:
            channel.close()

    def wait_migration(self, migration, timeout_s: float = 120):
        """The migration's record once it has ended (succeeded, failed, rolled back) or ``timeout_s`` passed."""
        from expertmesh.v1 import admin_pb2 as pb

        done = (pb.MIGRATION_PHASE_SUCCEEDED, pb.MIGRATION_PHASE_FAILED, pb.MIGRATION_PHASE_ROLLED_BACK)
        end = time.monotonic() + timeout_s
        while migration.phase not in done and time.monotonic() < end:
            time.sleep(0.2)
            migration = self.migration(migration.id)
        return migration

    def migrate(self, layer: int, expert: int, mode: int, target: str = "", source: str = "", timeout_s: float = 120):
        """One live migration through the orchestrator's admin API, waited for; BenchError unless it succeeds."""
        from expertmesh.v1 import admin_pb2 as pb

        migration = self.wait_migration(self.start_migration(layer, expert, mode, target, source), timeout_s)
        if migration.phase != pb.MIGRATION_PHASE_SUCCEEDED:
            raise BenchError(
                f"migration of layer {layer} expert {expert} ({pb.MigrationMode.Name(mode)}) ended "
                f"{pb.MigrationPhase.Name(migration.phase)}: {migration.reason}"
            )

    def describe(self, group: str) -> GroupView:
        return self.channels.describe(group)

    def group_answers(self, group: str) -> bool:
        try:
            self.describe(group)
            return True
        except GroupCallFailed:
            return False

    def router_version(self) -> int:
        """The routing-table version the router last reported serving (its heartbeat)."""
        beats = self.store.router_heartbeats()
        return max((b.table_version for b in beats.values()), default=0)

    def close(self) -> None:
        for child in (self.router, self.orchestrator):
            if child is not None:
                child.stop()
        if self._ray_started:
            import ray

            ray.shutdown()
        if self.channels is not None:
            self.channels.close()
        if self.store is not None:
            self.store.close()
        self.redis.kill()
        shutil.rmtree(self._workdir, ignore_errors=True)
