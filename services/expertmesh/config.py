"""Typed configuration of the data plane. Every field can come from YAML or from
an ``EXPERTMESH_<FIELD>`` environment variable (e.g. ``EXPERTMESH_STATE_URL``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


#: How a router reaches expert groups (``expertmesh.router.transport``).
TransportName = Literal["auto", "grpc", "grpc-unary"]


class DataPlaneConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    model: Path = Field(description="local HuggingFace checkpoint directory (config.json + safetensors)")
    groups: int = Field(2, ge=1, description="expert groups for the default contiguous split")
    placement: Path | None = Field(None, description="placement YAML (groups -> layer/expert pairs); overrides groups")
    gpu_placement: Path | None = Field(None, description="placement JSON of `expertmesh plan` (replicas on GPUs, shares)")
    topology: Path | None = Field(None, description="topology YAML the GPU placement refers to")
    group_per: Literal["gpu", "island"] = Field("gpu", description="with gpu_placement: one expert group per GPU or per NVLink island")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    state_url: str = Field("memory://", description="memory:// (embedded) or redis://host:port/db")
    ray_address: str | None = Field(None, description="join this Ray cluster instead of starting a local one")
    group_num_cpus: float = Field(0.25, gt=0, description="Ray CPUs reserved per expert group")
    group_host: str = Field("127.0.0.1", description="address group gRPC servers bind; 0.0.0.0 in a cluster")
    group_budget_bytes: int | None = Field(
        None, ge=1, description="bytes of expert weights one group may hold; LoadExperts past it is refused (unset: unlimited)"
    )
    dispatch_timeout_s: float = Field(30.0, gt=0, description="deadline of one expert-group call")
    transport: TransportName = Field(
        "auto",
        description="how the router reaches expert groups: auto (shared memory for groups on this host, else a gRPC "
        "stream), grpc (gRPC streams only), grpc-unary (one unary call per layer per group)",
    )
    load_window_s: float = Field(600.0, gt=0, description="sliding window of the router's expert-load statistics")
    load_publish_s: float = Field(10.0, gt=0, description="how often a router writes its load window to a shared store")
    heartbeat_s: float = Field(1.0, gt=0, description="how often a router reports the routing-table version it serves")
    quarantine_fallback: Literal["next_best", "renormalise"] = Field(
        "next_best",
        description="an expert whose every replica is quarantined: the gate picks the next-best expert in its slot, "
        "or its slot is dropped and the token's other experts renormalised",
    )


class ServingConfig(BaseSettings):
    """The public APIs of a router (``expertmesh up``): gRPC, and OpenAI-compatible HTTP with ``http_port``."""

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    host: str = Field("127.0.0.1", description="address the Inference gRPC server binds")
    port: int = Field(50051, ge=0, le=65535, description="its port (0 picks a free one)")
    max_active_sequences: int = Field(32, ge=1, description="sequences decoded together in one step")
    max_queued_requests: int = Field(128, ge=0, description="requests waiting for a slot; beyond: RESOURCE_EXHAUSTED")
    default_max_new_tokens: int = Field(64, ge=1, description="when a request does not say")
    max_new_tokens_cap: int = Field(1024, ge=1, description="requests asking for more are refused")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, time in-flight requests get to finish")
    health_port: int | None = Field(
        None, ge=0, le=65535, description="also serve grpc.health.v1 alone, in plaintext, on this port (kubelet gRPC probes cannot speak TLS)"
    )
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve the OpenAI-compatible HTTP API, /health and /metrics on this port, on host (0 picks one; unset: off)",
    )
    http_max_body_bytes: int = Field(4 << 20, ge=1024, description="HTTP request bodies larger than this are refused with 413")


class TlsConfig(BaseSettings):
    """TLS of every gRPC server and client of one process (``EXPERTMESH_TLS_*``).

    Environment only, no flags: a router passes these variables on to the expert
    groups it starts, so one setting covers every process of a deployment.
    Servers turn TLS on when ``cert_file`` and ``key_file`` are set; clients when
    ``ca_file`` or ``cert_file`` is, sending ``cert_file`` as their client
    certificate. Expert groups always require a client certificate signed by
    ``ca_file`` (mutual TLS: only routers and the orchestrator call them); the
    router's Inference API and the orchestrator's admin API only with
    ``require_client_cert``. Nothing set: plaintext (the embedded default).
    One certificate may serve both ends when it carries both the serverAuth and
    clientAuth key usages.
    """

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_TLS_", extra="forbid")

    cert_file: Path | None = Field(None, description="PEM certificate chain this process presents, as server and as client")
    key_file: Path | None = Field(None, description="PEM private key of cert_file")
    ca_file: Path | None = Field(None, description="PEM CA bundle peers' certificates must chain to (unset: clients trust the system roots)")
    require_client_cert: bool = Field(
        False, description="also require client certificates on the Inference and admin APIs (expert groups always do)"
    )
    group_server_name: str | None = Field(
        None, description="name expert-group certificates are issued for; group channels verify it instead of the IP they dial"
    )

    @model_validator(mode="after")
    def _complete(self) -> "TlsConfig":
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("EXPERTMESH_TLS_CERT_FILE and EXPERTMESH_TLS_KEY_FILE go together: set both or neither")
        if self.require_client_cert and self.ca_file is None:
            raise ValueError("EXPERTMESH_TLS_REQUIRE_CLIENT_CERT needs EXPERTMESH_TLS_CA_FILE, the CA client certificates chain to")
        return self

    @property
    def serves_tls(self) -> bool:
        return self.cert_file is not None

    @property
    def dials_tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None


class AdminAuthConfig(BaseSettings):
    """Who may call admin RPCs (``EXPERTMESH_ADMIN_*``): LoadExperts/UnloadExperts on expert
    groups and the orchestrator's ``expertmesh.v1.Admin`` service.

    An identity is a bearer token equal to ``token`` (or the contents of
    ``token_file``), or, over mutual TLS, a client certificate whose subject CN is
    in ``allowed_cns``. With neither configured (the embedded default) admin calls
    are accepted from loopback peers only. Clients send ``token`` when it is set.
    """

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_ADMIN_", extra="forbid")

    token: str | None = Field(None, description="bearer token of admin calls; prefer token_file on a cluster")
    token_file: Path | None = Field(None, description="file holding the token (read at start; surrounding whitespace ignored)")
    allowed_cns: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="client-certificate subject CNs accepted as admins (comma-separated in the environment)"
    )

    @field_validator("allowed_cns", mode="before")
    @classmethod
    def _split(cls, value):
        return tuple(n.strip() for n in value.split(",") if n.strip()) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_token_source(self) -> "AdminAuthConfig":
        if self.token and self.token_file:
            raise ValueError("set EXPERTMESH_ADMIN_TOKEN or EXPERTMESH_ADMIN_TOKEN_FILE, not both")
        return self


class FaultInjectionConfig(BaseSettings):
    """The expert groups' test-only fault hook (``InjectFault``: overwrite an expert's weights in
    place), which the chaos benchmark and tests use to check that the health monitor finds what
    memory faults do. Off unless ``EXPERTMESH_ENABLE_FAULT_INJECTION=1`` is set in the group's
    environment (a router passes it on to the groups it starts, like the TLS settings), so a
    production deployment refuses it even from an admin."""

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    enable_fault_injection: bool = Field(False, description="accept InjectFault (test and chaos runs only)")


def add_data_plane_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every command that starts a data plane shares (``up``, ``verify``, benchmarks)."""
    parser.add_argument("--model", type=Path, help="local checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--groups", type=int, default=2, help="expert groups (default contiguous split)")
    parser.add_argument("--placement", type=Path, help="placement YAML (groups -> layer/expert pairs) instead of --groups")
    parser.add_argument("--gpu-placement", type=Path, help="placement JSON of `expertmesh plan` (needs --topology)")
    parser.add_argument("--topology", type=Path, help="topology YAML the GPU placement was planned for")
    parser.add_argument("--group-per", choices=["gpu", "island"], default="gpu", help="with --gpu-placement")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    parser.add_argument(
        "--state-url", default=os.environ.get("EXPERTMESH_STATE_URL", "memory://"), help="memory:// or redis://host:port/db"
    )


def data_plane_config(args: argparse.Namespace) -> DataPlaneConfig:
    from expertmesh.embedded import default_checkpoint

    if args.model is None:
        print("[expertmesh] using the embedded tiny model (random weights)", flush=True, file=sys.stderr)
    return DataPlaneConfig(
        model=args.model or default_checkpoint(),
        groups=args.groups,
        placement=args.placement,
        gpu_placement=args.gpu_placement,
        topology=args.topology,
        group_per=args.group_per,
        dtype=args.dtype,
        ray_address=args.ray_address,
        state_url=args.state_url,
    )
