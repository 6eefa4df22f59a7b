"""TLS, mutual TLS and admin authorisation on real gRPC servers over loopback (no Ray).

What is real here: the certificates (a CA, server and client certificates made
with ``cryptography`` for each test session), the expert-group server
(``start_server`` on a tiny checkpoint, the code path every group runs), the
TLS handshakes (gRPC's own), the channels (``secure_or_insecure_channel`` and the
router's ``GroupClients``, configured from the ``EXPERTMESH_TLS_*`` environment
where the test says so) and the admin interceptor. What is not: the peer
address of the loopback rule, which cannot come from elsewhere on one machine,
so ``authorize`` is checked with peer strings as gRPC writes them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.client import AsyncClient, Client
from expertmesh.config.settings import AdminAuthConfig, TlsConfig
from expertmesh.contracts import wire
from expertmesh.contracts.errors import SecurityMisconfigured
from expertmesh.expert_group.service import start_server
from expertmesh.infra.group_channels import GroupClients, group_channel
from expertmesh.infra.grpc_server import GrpcServer
from expertmesh.infra.security import from_env
from expertmesh.infra.security.admin_auth import AdminPolicy, admin_metadata, authorize, is_loopback
from expertmesh.infra.security.tls import secure_or_insecure_channel
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc
from helpers import Up
from helpers import issue_certificate as _issue
from helpers import write_pem as _write

LAYER = 1
GROUP_NAME = "expertmesh-groups"  # the name the group certificate is issued for; dialled by IP
TOKEN = "s3cret-admin-token"
REFUSED_HANDSHAKE = grpc.StatusCode.UNAVAILABLE


# -- certificates -------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    #: client certificates by subject CN: (cert, key)
    clients: dict[str, tuple[Path, Path]]
    #: a client certificate signed by another CA
    stranger: tuple[Path, Path]

    def server(self, **kwargs) -> TlsConfig:
        return TlsConfig(cert_file=self.server_cert, key_file=self.server_key, ca_file=self.ca, **kwargs)

    def client(self, cn: str | None, server_name: str | None = GROUP_NAME) -> TlsConfig:
        cert, key = self.clients[cn] if cn else (None, None)
        return TlsConfig(cert_file=cert, key_file=key, ca_file=self.ca, group_server_name=server_name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = _issue("expertmesh test CA", None, ca=True)
    ca_path, _ = _write(root / "ca", *ca)
    # The group certificate names the group service only, no IP: dialling 127.0.0.1 needs group_server_name.
    server_cert, server_key = _write(root / "server", *_issue(GROUP_NAME, ca, dns=(GROUP_NAME, "localhost")))
    clients = {cn: _write(root / cn, *_issue(cn, ca)) for cn in ("router", "orchestrator")}
    other_ca = _issue("another CA", None, ca=True)
    stranger = _write(root / "stranger", *_issue("orchestrator", other_ca))
    return Pki(ca_path, server_cert, server_key, clients, stranger)


# -- a real expert-group server with mutual TLS ----------------------------------------------


def _group_server(tiny_checkpoints, tls: TlsConfig, admin: AdminAuthConfig):
    hosted = HostedExperts(Checkpoint(tiny_checkpoints("mixtral")))
    hosted.load([(LAYER, 1), (LAYER, 3)])
    return start_server("g-secure", hosted, tls=tls, admin=admin)


@pytest.fixture(scope="module")
def group(pki, tiny_checkpoints):
    """A group server with mutual TLS whose admin identity is the token alone."""
    server, port = _group_server(tiny_checkpoints, pki.server(), AdminAuthConfig(token=TOKEN))
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def cn_group(pki, tiny_checkpoints):
    """A group server with mutual TLS whose admins are the clients with certificate CN "orchestrator"."""
    server, port = _group_server(tiny_checkpoints, pki.server(), AdminAuthConfig(allowed_cns="orchestrator"))
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _dispatch_request() -> pb.DispatchRequest:
    hidden = torch.randn(3, 32)  # [T, H]
    ids = torch.tensor([[1, 3], [3, -1], [-1, 1]], dtype=torch.int32)  # [T, K]
    return pb.DispatchRequest(
        layer=LAYER,
        hidden_states=wire.encode(hidden),
        expert_ids=wire.encode(ids),
        routing_weights=wire.encode(torch.rand(3, 2)),
    )


def _code(call, *args, **kwargs) -> grpc.StatusCode:
    try:
        call(*args, **kwargs)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _load(stub, **kwargs):
    return stub.LoadExperts(pb.LoadExpertsRequest(experts=[pb.ExpertRef(layer=LAYER, expert=2)]), timeout=30, **kwargs)


def test_mtls_client_with_certificate_can_dispatch_and_describe(pki, group):
    """Real: a client with a certificate of the CA, through the helper the router and orchestrator use."""
    with group_channel(group, pki.client("router")) as channel:
        stub = pb_grpc.ExpertGroupStub(channel)
        partial = wire.decode(stub.Dispatch(_dispatch_request(), timeout=30).partial_sums)
        assert partial.shape == (3, 32)
        assert stub.Describe(pb.DescribeRequest(), timeout=30).group == "g-secure"
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "who",
    ["TLS without a client certificate", "client certificate of another CA", "plaintext", "TLS, wrong server name"],
)
def test_group_refuses_clients_that_do_not_pass_mutual_tls(pki, group, who):
    """Real handshakes: each client reaches the port and is refused before any RPC runs."""
    tls = {
        "TLS without a client certificate": pki.client(None),
        "client certificate of another CA": TlsConfig(
            cert_file=pki.stranger[0], key_file=pki.stranger[1], ca_file=pki.ca, group_server_name=GROUP_NAME
        ),
        "plaintext": TlsConfig(),
        # The certificate names the group service, not 127.0.0.1: without group_server_name verification fails.
        "TLS, wrong server name": pki.client("router", server_name=None),
    }[who]
    with group_channel(group, tls) as channel:
        assert _code(pb_grpc.ExpertGroupStub(channel).Dispatch, _dispatch_request(), timeout=10) == REFUSED_HANDSHAKE


def test_admin_call_needs_the_token(pki, group):
    """Real: LoadExperts over mutual TLS with no token, a wrong one and the right one (admin_metadata)."""
    with group_channel(group, pki.client("router")) as channel:
        stub = pb_grpc.ExpertGroupStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            _load(stub)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "needs an identity" in err.value.details() and "Bearer" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            _load(stub, metadata=admin_metadata(AdminAuthConfig(token="not-the-token")))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "is not this server's admin token" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            _load(stub, metadata=(("authorization", "Basic abc"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "'Bearer <admin token>'" in err.value.details()
        loaded = _load(stub, metadata=admin_metadata(AdminAuthConfig(token=TOKEN)))
        assert [(r.layer, r.expert) for r in loaded.loaded] == [(LAYER, 2)]
        unloaded = stub.UnloadExperts(
            pb.UnloadExpertsRequest(experts=[pb.ExpertRef(layer=LAYER, expert=2)]),
            metadata=admin_metadata(AdminAuthConfig(token=TOKEN)),
        )
        assert [(r.layer, r.expert) for r in unloaded.unloaded] == [(LAYER, 2)]
        # Data-plane calls stay open to any TLS peer: Describe without a token.
        assert stub.Describe(pb.DescribeRequest(), timeout=30).experts


def test_inject_fault_is_an_admin_call_and_off_unless_enabled(pki, group):
    """Real: the test-only fault hook needs the admin identity first; with it, a group started
    without EXPERTMESH_ENABLE_FAULT_INJECTION still refuses."""
    request = pb.InjectFaultRequest(expert=pb.ExpertRef(layer=LAYER, expert=1), kind=pb.FAULT_KIND_NAN)
    with group_channel(group, pki.client("router")) as channel:
        stub = pb_grpc.ExpertGroupStub(channel)
        assert _code(stub.InjectFault, request, timeout=30) == grpc.StatusCode.UNAUTHENTICATED
        token = admin_metadata(AdminAuthConfig(token=TOKEN))
        assert _code(stub.InjectFault, request, timeout=30, metadata=token) == grpc.StatusCode.FAILED_PRECONDITION


def test_admin_identity_by_client_certificate_cn(pki, cn_group):
    """Real: the CN of the verified client certificate decides; no token involved."""
    with group_channel(cn_group, pki.client("orchestrator")) as channel:
        assert _code(_load, pb_grpc.ExpertGroupStub(channel)) == grpc.StatusCode.OK
    with group_channel(cn_group, pki.client("router")) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _load(pb_grpc.ExpertGroupStub(channel))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "CN router is not among the admin CNs" in err.value.details()
        # A token is not an identity on a server that accepts none.
        with pytest.raises(grpc.RpcError) as err:
            _load(pb_grpc.ExpertGroupStub(channel), metadata=admin_metadata(AdminAuthConfig(token=TOKEN)))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "accepts no admin token" in err.value.details()


def test_router_group_clients_dial_mutual_tls_from_the_environment(pki, group, monkeypatch):
    """Real: the router's GroupClients, configured only by EXPERTMESH_TLS_* as in a deployment."""
    cert, key = pki.clients["router"]
    for name, value in {
        "CERT_FILE": cert,
        "KEY_FILE": key,
        "CA_FILE": pki.ca,
        "GROUP_SERVER_NAME": GROUP_NAME,
    }.items():
        monkeypatch.setenv(f"EXPERTMESH_TLS_{name}", str(value))
    clients = GroupClients()
    try:
        clients.update({"g-secure": group})
        partial = clients.stub("g-secure").Dispatch(_dispatch_request(), timeout=30).partial_sums
        assert list(partial.shape) == [3, 32]
    finally:
        clients.close()
    for name in ("CERT_FILE", "KEY_FILE", "CA_FILE", "GROUP_SERVER_NAME"):
        monkeypatch.delenv(f"EXPERTMESH_TLS_{name}")
    plaintext = GroupClients()
    try:
        plaintext.update({"g-secure": group})
        assert _code(plaintext.stub("g-secure").Dispatch, _dispatch_request(), timeout=10) == REFUSED_HANDSHAKE
    finally:
        plaintext.close()


# -- other servers: the Inference client, the admin service, plaintext health ---------------------


@pytest.fixture
def bare_tls_server(pki):
    """A GrpcServer with TLS (server certificate only) and the Admin service's generated base
    servicer, which answers UNIMPLEMENTED: enough to show what the interceptor lets through."""
    server = GrpcServer(
        "test",
        "127.0.0.1",
        0,
        tls=TlsConfig(cert_file=pki.server_cert, key_file=pki.server_key),
        admin=AdminAuthConfig(token=TOKEN),
    )
    admin_pb2_grpc.add_AdminServicer_to_server(admin_pb2_grpc.AdminServicer(), server.server)
    server.start()
    yield server
    server.stop(0)


def test_inference_clients_dial_tls(pki, bare_tls_server):
    """Real: Client and AsyncClient against a TLS server with no Inference service; UNIMPLEMENTED
    means the handshake passed and the call reached the server, UNAVAILABLE that it did not."""
    target = f"localhost:{bare_tls_server.port}"
    with Client(target, timeout=10, tls=TlsConfig(ca_file=pki.ca)) as client:
        assert _code(client.models) == grpc.StatusCode.UNIMPLEMENTED
    with Client(target, timeout=10, tls=TlsConfig()) as client:
        assert _code(client.models) == REFUSED_HANDSHAKE

    async def models_code() -> grpc.StatusCode:
        async with AsyncClient(target, timeout=10, tls=TlsConfig(ca_file=pki.ca)) as client:
            try:
                await client.models()
            except grpc.aio.AioRpcError as err:
                return err.code()
        return grpc.StatusCode.OK

    assert asyncio.run(models_code()) == grpc.StatusCode.UNIMPLEMENTED


def test_admin_service_is_guarded_by_prefix(pki, bare_tls_server):
    """Real: every method of expertmesh.v1.Admin, unary and streaming, needs the token."""
    with secure_or_insecure_channel(f"localhost:{bare_tls_server.port}", tls=TlsConfig(ca_file=pki.ca)) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        calls = [
            lambda **kw: stub.ListMigrations(admin_pb2.ListMigrationsRequest(), timeout=10, **kw),
            lambda **kw: list(stub.WatchMigrations(admin_pb2.WatchMigrationsRequest(), timeout=10, **kw)),
        ]
        for call in calls:
            assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(call, metadata=admin_metadata(AdminAuthConfig(token=TOKEN))) == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_health_port_serves_health_only(pki, bare_tls_server):
    """Real: the probe port answers grpc.health.v1 in plaintext and has no other service."""
    port = bare_tls_server.serve_plaintext_health(0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        listed = admin_pb2_grpc.AdminStub(channel).ListMigrations
        assert _code(listed, admin_pb2.ListMigrationsRequest(), timeout=10) == grpc.StatusCode.UNIMPLEMENTED


def test_embedded_default_is_plaintext_and_admin_from_loopback(tiny_checkpoints):
    """Real: no EXPERTMESH_TLS_* / EXPERTMESH_ADMIN_* at all (make run): plaintext, and admin calls
    from loopback succeed without a token."""
    server, port = _group_server(tiny_checkpoints, from_env(TlsConfig), from_env(AdminAuthConfig))
    try:
        with group_channel(f"127.0.0.1:{port}") as channel:
            assert _code(_load, pb_grpc.ExpertGroupStub(channel)) == grpc.StatusCode.OK
    finally:
        server.stop(0)


@pytest.mark.slow
def test_up_serves_tls_end_to_end(pki, tmp_path, shared_ray_address):
    """Real: `expertmesh up` (on the tests' shared Ray, two expert groups as Serve replicas, the router) with only
    EXPERTMESH_TLS_* set, as a deployment sets them: the groups get the settings from the router
    and require its client certificate, the router serves TLS, a client with the CA generates."""
    cert, key = pki.server_cert, pki.server_key  # one certificate, both usages: server and client
    env = {
        "EXPERTMESH_HOME": str(tmp_path),
        "EXPERTMESH_TLS_CERT_FILE": str(cert),
        "EXPERTMESH_TLS_KEY_FILE": str(key),
        "EXPERTMESH_TLS_CA_FILE": str(pki.ca),
        "EXPERTMESH_TLS_GROUP_SERVER_NAME": GROUP_NAME,
    }
    up = Up("--ray-address", shared_ray_address, env=env)
    try:
        target = "localhost:" + up.target.rpartition(":")[2]  # the name the certificate carries
        with Client(target, timeout=60, tls=TlsConfig(ca_file=pki.ca)) as client:
            assert client.generate_text([5, 6, 7], max_new_tokens=4, stop_at_eos=False)
        with Client(target, timeout=10, tls=TlsConfig()) as client:
            assert _code(client.models) == REFUSED_HANDSHAKE
    finally:
        up.stop()


# -- the rules, without servers --------------------------------------------------------------------


def test_loopback_rule_and_peer_strings():
    """Pure: remote peers are refused when no admin identity is configured."""
    open_policy = AdminPolicy(token=None, allowed_cns=frozenset())
    for peer in ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "ipv6:[::ffff:127.0.0.1]:5000", "unix:/tmp/s"):
        assert is_loopback(peer), peer
        assert authorize("/m", (), peer, (), open_policy) is None
    for peer in ("ipv4:10.0.0.7:5000", "ipv6:[fd00::1]:5000", "ipv4:not-an-ip:1", "weird"):
        assert not is_loopback(peer), peer
    refusal = authorize("/expertmesh.v1.Admin/Migrate", (), "ipv4:10.0.0.7:5000", (), open_policy)
    assert refusal.code == grpc.StatusCode.PERMISSION_DENIED and "EXPERTMESH_ADMIN_TOKEN" in refusal.message
    # With an identity configured, loopback is no identity.
    refusal = authorize("/m", (), "ipv4:127.0.0.1:5000", (), AdminPolicy(TOKEN, frozenset()))
    assert refusal.code == grpc.StatusCode.UNAUTHENTICATED


def test_settings_from_the_environment(monkeypatch, tmp_path):
    """Real files and variables: incomplete TLS settings are refused with a line naming them;
    the token file and the comma-separated CN list are read as documented."""
    monkeypatch.setenv("EXPERTMESH_TLS_CERT_FILE", "/nonexistent.crt")
    with pytest.raises(SecurityMisconfigured, match="EXPERTMESH_TLS_CERT_FILE and EXPERTMESH_TLS_KEY_FILE go together"):
        from_env(TlsConfig)
    monkeypatch.setenv("EXPERTMESH_TLS_KEY_FILE", "/nonexistent.key")
    with pytest.raises(SecurityMisconfigured, match="cannot read the TLS private key /nonexistent.key"):
        GrpcServer("test", "127.0.0.1", 0)
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    monkeypatch.setenv("EXPERTMESH_ADMIN_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("EXPERTMESH_ADMIN_ALLOWED_CNS", "orchestrator, admin-bot")
    assert admin_metadata() == (("authorization", f"Bearer {TOKEN}"),)
    assert from_env(AdminAuthConfig).allowed_cns == ("orchestrator", "admin-bot")
    monkeypatch.setenv("EXPERTMESH_ADMIN_TOKEN", "x")
    with pytest.raises(SecurityMisconfigured, match="not both"):
        from_env(AdminAuthConfig)
    monkeypatch.delenv("EXPERTMESH_ADMIN_TOKEN")
    with pytest.raises(SecurityMisconfigured, match="requires client certificates"):
        GrpcServer(
            "test",
            "127.0.0.1",
            0,
            tls=TlsConfig(cert_file=token_file, key_file=token_file),
            admin=AdminAuthConfig(),
            require_client_cert=True,
        )
