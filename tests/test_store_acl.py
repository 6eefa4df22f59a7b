"""The state store's Redis users, against a real redis-server started here with the ACL file that
``expertmesh store acl --password-dir`` writes: each component's user may run exactly the store calls that
``store.access.LAYOUT`` gives it and is refused the rest with a clear PERMISSION_DENIED error (a router's
quarantine write above all); passwords come from files and reach neither Redis nor a command line in the clear;
``rediss://`` speaks TLS to a Redis that requires it, verifying its certificate against the CA file."""

from __future__ import annotations

import hashlib
import inspect
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis

from expertmesh.cli.main import main
from expertmesh.config.settings import RedisAuthConfig
from expertmesh.contracts.errors import StoreAccessDenied
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.infra.ports import free_port
from expertmesh.store import QuarantinedReplica, RouterHeartbeat, StateStore, open_store
from expertmesh.store.access import LAYOUT, Role, declared
from helpers import issue_certificate, write_pem

pytestmark = pytest.mark.redis

DEPLOYMENT = "acl"
REPLICA = QuarantinedReplica(0, 1, "g0", "quarantined", "odd outputs", 1.0, False)

#: every public StateStore call: (the layout key it touches, read or write, the call)
CALLS = {
    "routing_table_version": ("routing_table:version", "read", lambda s: s.routing_table_version()),
    "routing_table": ("routing_table", "read", lambda s: s.routing_table()),
    "publish_routing_table": (
        "routing_table:version",
        "write",
        lambda s: s.publish_routing_table(RoutingTable(s.routing_table_version() + 1, 2, {(0, 0): ("g0",)})),
    ),
    "placement_digest": ("placement", "read", lambda s: s.placement_digest()),
    "set_placement_digest": ("placement", "write", lambda s: s.set_placement_digest("d")),
    "set_endpoint": ("endpoints", "write", lambda s: s.set_endpoint("g0", "127.0.0.1:1")),
    "remove_endpoint": ("endpoints", "write", lambda s: s.remove_endpoint("g9")),
    "endpoints": ("endpoints", "read", lambda s: s.endpoints()),
    "publish_load": ("load", "write", lambda s: s.publish_load("r1", b"x")),
    "loads": ("load", "read", lambda s: s.loads()),
    "publish_load_detail": ("load_detail", "write", lambda s: s.publish_load_detail("r1", b"x")),
    "load_details": ("load_detail", "read", lambda s: s.load_details()),
    "remove_load": ("load", "write", lambda s: s.remove_load("r9")),  # and its detail: the same writers
    "publish_router_heartbeat": ("routers", "write", lambda s: s.publish_router_heartbeat(RouterHeartbeat("r1", 1, 0))),
    "remove_router_heartbeat": ("routers", "write", lambda s: s.remove_router_heartbeat("r9")),
    "router_heartbeats": ("routers", "read", lambda s: s.router_heartbeats()),
    "router_count": ("routers", "read", lambda s: s.router_count()),
    "save_migration": ("migrations", "write", lambda s: s.save_migration("m1", b"{}")),
    "migration": ("migrations", "read", lambda s: s.migration("m1")),
    "migrations": ("migrations", "read", lambda s: s.migrations()),
    "remove_migration": ("migrations", "write", lambda s: s.remove_migration("m9")),
    "save_group_record": ("groups", "write", lambda s: s.save_group_record("g9", b"{}")),
    "group_records": ("groups", "read", lambda s: s.group_records()),
    "remove_group_record": ("groups", "write", lambda s: s.remove_group_record("g8")),
    "set_quarantined": ("quarantine", "write", lambda s: s.set_quarantined(REPLICA)),
    "clear_quarantined": ("quarantine", "write", lambda s: s.clear_quarantined(9, 9, "g9")),
    "quarantined": ("quarantine", "read", lambda s: s.quarantined()),
    "save_health_record": ("health", "write", lambda s: s.save_health_record("0/1/g0", b"{}")),
    "remove_health_record": ("health", "write", lambda s: s.remove_health_record("9/9/g9")),
    "health_records": ("health", "read", lambda s: s.health_records()),
    "publish_hidden_sample": ("hidden_samples:*", "write", lambda s: s.publish_hidden_sample(0, "r1", b"x")),
    "hidden_samples": ("hidden_samples:*", "read", lambda s: s.hidden_samples(0)),
    "remove_hidden_samples": ("hidden_samples:*", "write", lambda s: s.remove_hidden_samples("r9", [0])),
    "save_health_probe": ("health_probes", "write", lambda s: s.save_health_probe(0, b"x")),
    "health_probes": ("health_probes", "read", lambda s: s.health_probes()),
    "save_profile": ("profiles", "write", lambda s: s.save_profile("code", b"{}")),
    "profiles": ("profiles", "read", lambda s: s.profiles()),
    "save_policy_quality": ("policy_quality", "write", lambda s: s.save_policy_quality("exact", b"{}")),
    "policy_quality": ("policy_quality", "read", lambda s: s.policy_quality()),
    "publish_anomalies": ("anomalies", "write", lambda s: s.publish_anomalies("r1", [])),
    "remove_anomalies": ("anomalies", "write", lambda s: s.remove_anomalies("r9")),
    "anomalies": ("anomalies", "read", lambda s: s.anomalies()),
}


class AclRedis:
    """redis-server on a loopback port with the ACL file of ``expertmesh store acl`` (TLS-only when ``tls``
    gives (cert, key, ca))."""

    def __init__(self, root: Path, tls: tuple[Path, Path, Path] | None = None):
        self.passwords = root / "passwords"
        self.passwords.mkdir(parents=True)
        for role in Role:  # as a mounted Secret's files: a trailing newline is not part of the password
            (self.passwords / role.value).write_text(f"{role.value}-{uuid.uuid4().hex}\n")
        self.acl = root / "users.acl"
        assert (
            main(
                [
                    "store",
                    "acl",
                    "--deployment",
                    DEPLOYMENT,
                    "--password-dir",
                    str(self.passwords),
                    "--out",
                    str(self.acl),
                ]
            )
            == 0
        )
        self.port = free_port()
        self.tls = tls
        ports = ["--port", str(self.port)]
        if tls is not None:
            cert, key, ca = tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert)]
            ports += ["--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen(
            [shutil.which("redis-server"), "--bind", "127.0.0.1", *ports, "--save", "", "--appendonly", "no"]
            + ["--dir", str(root), "--aclfile", str(self.acl)],
            stdout=subprocess.DEVNULL,
        )
        self.url = f"{'rediss' if tls else 'redis'}://localhost:{self.port}/0"
        deadline = time.monotonic() + 30
        while True:
            try:
                self.store(Role.ORCHESTRATOR).close()
                break
            except ConnectionError:
                assert time.monotonic() < deadline and self.proc.poll() is None, "redis-server did not start"
                time.sleep(0.1)

    def auth(self, role: Role) -> RedisAuthConfig:
        ca = self.tls[2] if self.tls else None
        return RedisAuthConfig(username=role.value, password_file=self.passwords / role.value, ca_file=ca)

    def store(self, role: Role) -> StateStore:
        return open_store(self.url, DEPLOYMENT, self.auth(role))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    server = AclRedis(tmp_path_factory.mktemp("acl-redis"))
    yield server
    server.close()


def test_every_store_call_is_listed_and_every_key_declared():
    """A new StateStore call must be added to CALLS, and its key to LAYOUT (the store refuses it otherwise)."""
    public = {n for n, _ in inspect.getmembers(StateStore, inspect.isfunction) if not n.startswith("_")} - {"close"}
    assert public == set(CALLS)
    assert {declared(key).name for key, _, _ in CALLS.values()} == {k.name for k in LAYOUT}
    with pytest.raises(KeyError, match="not declared"):
        open_store()._key("tokens")


@pytest.mark.parametrize("role", list(Role))
def test_each_components_user_may_do_exactly_what_the_layout_gives_it(acl_redis, role):
    store = acl_redis.store(role)
    try:
        for name, (key, access, call) in CALLS.items():
            entry = declared(key)
            allowed = role in (entry.writers if access == "write" else entry.readers)
            if allowed:
                call(store)
            else:
                with pytest.raises(StoreAccessDenied, match=f"to user '{role.value}'"):
                    call(store)
    finally:
        store.close()


def test_a_routers_quarantine_write_is_refused_with_a_clear_error(acl_redis):
    """The issue's case: a compromised router lifting or adding quarantines fleet-wide."""
    router, orchestrator = acl_redis.store(Role.ROUTER), acl_redis.store(Role.ORCHESTRATOR)
    try:
        orchestrator.set_quarantined(REPLICA)
        with pytest.raises(StoreAccessDenied) as refused:
            router.clear_quarantined(0, 1, "g0")
        assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
        message = str(refused.value)
        assert "hdel of 'expertmesh:acl:quarantine'" in message and "user 'router'" in message
        assert "expertmesh store acl" in message
        assert router.quarantined() == {(0, 1, "g0"): REPLICA}, "it still reads them"
        with pytest.raises(StoreAccessDenied):
            router.set_endpoint("g0", "10.0.0.66:50061")  # pointing traffic at a fake group
    finally:
        router.close(), orchestrator.close()


def test_passwords_come_from_files_and_reach_redis_only_hashed(acl_redis):
    acl = acl_redis.acl.read_text()
    assert acl_redis.acl.stat().st_mode & 0o077 == 0, "the ACL file is its owner's alone"
    cmdline = Path(f"/proc/{acl_redis.proc.pid}/cmdline").read_bytes().decode()
    for role in Role:
        password = (acl_redis.passwords / role.value).read_text().strip()
        assert password not in acl and password not in cmdline
        assert f"user {role.value} on #{hashlib.sha256(password.encode()).hexdigest()} " in acl
    assert "user default off" in acl
    with pytest.raises(redis.AuthenticationError):  # no user: refused
        redis.Redis(port=acl_redis.port).ping()
    wrong = RedisAuthConfig(username="router", password="guess")
    with pytest.raises(ConnectionError, match="refused user 'router'"):
        open_store(acl_redis.url, DEPLOYMENT, wrong)


def test_the_environment_names_the_user_and_its_password_file(acl_redis, monkeypatch):
    monkeypatch.setenv("EXPERTMESH_REDIS_USERNAME", "expert-group")
    monkeypatch.setenv("EXPERTMESH_REDIS_PASSWORD_FILE", str(acl_redis.passwords / "expert-group"))
    store = open_store(acl_redis.url, DEPLOYMENT)
    try:
        store.set_endpoint("g1", "127.0.0.1:2")
        with pytest.raises(StoreAccessDenied, match="user 'expert-group'"):
            store.save_profile("code", b"{}")
    finally:
        store.close()
    monkeypatch.setenv("EXPERTMESH_REDIS_PASSWORD", "both")
    with pytest.raises(Exception, match="not both"):
        open_store(acl_redis.url, DEPLOYMENT)


def test_rediss_speaks_tls_and_verifies_the_server_against_the_ca_file(tmp_path):
    ca = issue_certificate("expertmesh test CA", None, ca=True)
    ca_cert, _ = write_pem(tmp_path / "ca", *ca)
    cert, key = write_pem(tmp_path / "redis", *issue_certificate("redis", ca, dns=("localhost",), ips=("127.0.0.1",)))
    server = AclRedis(tmp_path, tls=(cert, key, ca_cert))
    try:
        store = server.store(Role.ORCHESTRATOR)
        store.set_quarantined(REPLICA)
        assert store.quarantined() == {(0, 1, "g0"): REPLICA}
        store.close()
        plaintext = server.url.replace("rediss://", "redis://")
        with pytest.raises(ConnectionError):
            open_store(plaintext, DEPLOYMENT, server.auth(Role.ORCHESTRATOR))
        untrusted = server.auth(Role.ORCHESTRATOR).model_copy(update={"ca_file": None})
        with pytest.raises(ConnectionError, match="certificate verify failed"):
            open_store(server.url, DEPLOYMENT, untrusted)
    finally:
        server.close()


@pytest.mark.slow
def test_every_component_runs_under_its_own_user(tiny_checkpoints, tmp_path):
    """The rights are what the components need, not only what the layout says: plain-process expert groups,
    `expertmesh orchestrator --health-monitor` and `expertmesh up --router-only`, each logged in as its own
    user (a password file), bring the platform up, serve, report, sample, probe and quarantine, with no call
    refused."""
    import os
    import re
    import signal
    import threading

    import yaml

    from expertmesh.client import Client
    from expertmesh.contracts import group_map as placement_mod
    from expertmesh.models.checkpoint import Checkpoint
    from expertmesh.orchestrator import admin_client
    from expertmesh.platform.group_processes import start_groups
    from expertmesh.v1 import admin_pb2
    from helpers import Up, orchestrator_argv, wait_for

    def env(role: Role) -> dict[str, str]:
        return {
            "EXPERTMESH_DEPLOYMENT": DEPLOYMENT,
            "EXPERTMESH_REDIS_USERNAME": role.value,
            "EXPERTMESH_REDIS_PASSWORD_FILE": str(acl_redis.passwords / role.value),
        }

    acl_redis = AclRedis(tmp_path / "redis")  # a server of its own: empty, as a new deployment's
    path = tiny_checkpoints("mixtral")
    placement = placement_mod.contiguous(Checkpoint(path).spec, 2)
    placement_file = tmp_path / "placement.yaml"
    placement_file.write_text(
        yaml.safe_dump(
            {
                "groups": {
                    g: {l: sorted(e for k, e in pairs if k == l) for l, _ in pairs}
                    for g, pairs in placement.groups.items()
                }
            }
        )
    )
    store = acl_redis.store(Role.ORCHESTRATOR)
    groups = start_groups(
        ["g0", "g1"], ["--model", str(path), "--groups", "2", "--state-url", acl_redis.url], env(Role.EXPERT_GROUP)
    )
    orchestrator = subprocess.Popen(
        orchestrator_argv(acl_redis.url, path, placement_file, "--no-kube", "--interval", "0.5", "--health-monitor"),
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            **env(Role.ORCHESTRATOR),
            "EXPERTMESH_HEALTH_INTERVAL_S": "1",
            "EXPERTMESH_HEALTH_TOKENS": "32",
        },
    )
    orchestrator_log: list[str] = []
    threading.Thread(target=lambda: orchestrator_log.extend(orchestrator.stderr), daemon=True).start()
    router = None
    try:
        admin_address = wait_for(
            lambda: next(
                (m.group(1) for line in orchestrator_log if (m := re.search(r"admin gRPC on (\S+:\d+)", line))), None
            ),
            "the orchestrator's admin API",
            180,
        )
        router = Up(
            "--router-only",
            "--model",
            str(path),
            "--state-url",
            acl_redis.url,
            env={
                **env(Role.ROUTER),
                "EXPERTMESH_HEARTBEAT_S": "0.2",
                "EXPERTMESH_LOAD_PUBLISH_S": "0.5",
                "EXPERTMESH_HIDDEN_SAMPLE_TOKENS": "32",
            },
        )
        with Client(router.target, timeout=60) as client:
            first = [
                t for c in client.generate([5, 17, 40, 9], max_new_tokens=6, stop_at_eos=False) for t in c.token_ids
            ]
        assert len(first) == 6
        wait_for(
            lambda: store.router_heartbeats() and store.loads() and store.hidden_samples(0), "the router's reports", 60
        )
        replicas = sum(len(pairs) for pairs in placement.groups.values())
        wait_for(lambda: len(store.health_records()) == replicas, "a health round over every replica", 120)
        channel, stub = admin_client.connect(admin_address)
        with channel:
            admin_client.call(stub.Quarantine, admin_pb2.QuarantineRequest(layer=0, expert=0, reason="acl test"))
        wait_for(lambda: (0, 0, "g0") in store.quarantined(), "the quarantine", 30)
        with Client(router.target, timeout=60) as client:
            assert [
                t for c in client.generate([5, 17, 40, 9], max_new_tokens=6, stop_at_eos=False) for t in c.token_ids
            ]
    finally:
        if router is not None:
            assert router.stop() == 0
        orchestrator.send_signal(signal.SIGTERM)
        orchestrator.wait(timeout=60)
        for group in groups.values():
            group.stop()
        store.close()
        acl_redis.close()
    logs = (
        "".join(orchestrator_log)
        + "".join(router.stderr if router else [])
        + "".join(line for g in groups.values() for line in g.stderr)
    )
    assert "PERMISSION_DENIED" not in logs and "NOPERM" not in logs and "StoreAccessDenied" not in logs, logs[-3000:]
