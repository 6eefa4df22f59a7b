"""Typed configuration of the data plane and of a router's public APIs, and where each setting
comes from.

One order of precedence for every command that takes these settings (``up``, ``verify``, ``group
serve``, ``orchestrator``, the benchmarks that start a data plane):

    defaults (the fields below) < config file (``--config FILE.yaml``)
        < ``EXPERTMESH_<FIELD>`` environment variables < flags given on the command line

Flags default to unset, so they override only what was given. A config file's keys are the field
names (``groups: 4``, ``state_url: redis://redis:6379/0``) or, where a setting is also a Helm
value, its key in the chart's values (``model: {path, dtype}``, ``router: {port, healthPort,
http: {enabled, port}}``, ``expertGroups: {numCpus}``, ``redis: {external: {url}}``), so the same
words mean the same thing everywhere. A bad key or value is one line that names it where it was
written: ``--groups``, ``EXPERTMESH_GROUPS`` or ``FILE: groups``.
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, TypeVar

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict, SettingsError

from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest


class ConfigError(ExpertMeshError):
    """A setting has an unknown key or a bad value, in a flag, the environment or a config file."""


#: How a router reaches expert groups (``expertmesh.router.transport.base``).
TransportName = Literal["auto", "grpc", "grpc-unary"]
#: what a router does on an anomaly (``router.reporting.anomaly_monitor``): exact routing while a gate-confidence
#: anomaly lasts, a record asking the health monitor for an early round on the implicated experts, or both
AnomalyAction = Literal["none", "exact_routing", "health_round", "exact_routing+health_round"]
#: what ``router_device`` (and ``bench dispatch --device``) may say
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")
DEVICE_NAMES = "a device is auto, cpu, cuda or cuda:N"
#: the consistency guard's threshold (the field report's) and how it computes a rolled-back token again:
#: widened (top-3) or with the stock gate (exact routing)
GUARD_THRESHOLD = 0.65
GUARD_RECOMPUTE = ("widened", "exact")
#: tokens the guard computes again per request: by default, and at most
GUARD_MAX_REGENERATIONS = 8
GUARD_REGENERATIONS_LIMIT = 64


#: the routers' load-publish budget unless configured: at DeepSeek-V3's shape (about 100 KB a publish) it binds from
#: about 50 routers on (``contracts.load_report``)
LOAD_INFLOW_BUDGET_BYTES_S = 512 * 1024


class DataPlaneConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    model: Path = Field(
        description="checkpoint: a local directory (config.json + safetensors), a Hub id ORG/NAME (from the local "
        "Hub cache, else downloaded), or domain-moe (the small MoE trained on the multi-domain corpus, cached)"
    )
    revision: str | None = Field(None, description="with a Hub id: branch, tag or commit of the model (unset: main)")
    model_name: str | None = Field(
        None,
        description="name the APIs serve the model under (unset: the Hub id, else the checkpoint directory's name)",
    )
    groups: int = Field(2, ge=1, description="expert groups for the default contiguous split")
    placement: Path | None = Field(None, description="placement YAML (groups -> layer/expert pairs); overrides groups")
    gpu_placement: Path | None = Field(
        None, description="placement JSON of `expertmesh plan` (replicas on GPUs, shares)"
    )
    topology: Path | None = Field(None, description="topology YAML the GPU placement refers to")
    group_per: Literal["gpu", "island"] = Field(
        "gpu", description="with gpu_placement: one expert group per GPU or per NVLink island"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the router and groups compute in"
    )
    router_device: str = Field(
        "auto",
        description="device of the router's model (attention, gates, LM head): auto (the first CUDA GPU when there is "
        "one, else cpu), cpu, cuda or cuda:N",
    )
    state_url: str = Field("memory://", description="memory:// (embedded) or redis://host:port/db")
    deployment: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="name of this deployment in the state store: its keys are under expertmesh:<deployment>:, so "
        "deployments sharing one Redis database never read or overwrite each other's tables",
    )
    table_poll_s: float = Field(
        0.25, gt=0, le=60, description="how often a router's table watcher asks the state store for a new routing table"
    )
    ray_address: str | None = Field(None, description="join this Ray cluster instead of starting a local one")
    group_num_cpus: float = Field(0.25, gt=0, description="Ray CPUs reserved per expert group")
    group_wait_for_room_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description="`groups add` on Ray where the cluster has no room free now: 0 refuses it; more deploys the "
        "group anyway and waits this many seconds for Ray to place it (a pending demand the Ray / KubeRay "
        "autoscaler adds a node for, or room another change frees)",
    )
    router_threads: int = Field(
        0,
        ge=0,
        le=4096,
        description="torch intra-op threads of `expertmesh up`'s router; 0: auto, every CPU of the host (the router "
        "and its local expert groups take turns each MoE layer, and idle OpenMP threads sleep)",
    )
    in_process_side_by_side: bool = Field(
        True,
        description="`up --groups-as in-process`: a MoE layer's calls to the groups in the router's process computed "
        "side by side, each on an equal share of the router's intra-op threads (faster on a host of few cores: small "
        "products spread over every thread wait on each other); false: one after another, each on all of them",
    )
    group_host: str = Field("127.0.0.1", description="address group gRPC servers bind; 0.0.0.0 in a cluster")
    group_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="bytes of expert weights one group may hold; LoadExperts past it is refused (unset: unlimited)",
    )
    dispatch_timeout_s: float = Field(30.0, gt=0, description="deadline of one expert-group call")
    sole_group_wait_s: float = Field(
        1.0,
        ge=0,
        le=600,
        description="how long a step resends to an expert group that went away holding experts no other replica has "
        "(a blip, a replica restarting), within dispatch_timeout_s and the requests' deadlines, before its requests "
        "fail with UNAVAILABLE; the step holds every sequence meanwhile. 0: fail at once",
    )
    hedge_calls: bool = Field(
        True,
        description="send a group call that has not answered within its hedge delay to other replicas of its experts "
        "too, and sum whichever complete answer comes first (a hung group then holds a step for the delay, not "
        "dispatch_timeout_s, and its breaker keeps it out at once); calls of experts with no other replica are never "
        "hedged",
    )
    hedge_delay_min_s: float = Field(
        0.05,
        gt=0,
        le=60,
        description="the shortest hedge delay: the delay is 3x the p99 of the group's recent calls of the same size, "
        "within hedge_delay_min_s and hedge_delay_max_s (the same value in both: a fixed delay, for calls that "
        "normally take less)",
    )
    hedge_delay_max_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="the longest hedge delay, unless 1.5x that p99 is longer; also the delay of a group's calls of a "
        "size it has not answered 20 of yet",
    )
    transport: TransportName = Field(
        "auto",
        description="how the router reaches expert groups: auto (shared memory for groups on this host, else a gRPC "
        "stream), grpc (gRPC streams only), grpc-unary (one unary call per layer per group)",
    )
    load_window_s: float = Field(600.0, gt=0, description="sliding window of the router's expert-load statistics")
    load_publish_s: float = Field(10.0, gt=0, description="how often a router writes its load window to a shared store")
    load_inflow_budget_bytes_s: float = Field(
        LOAD_INFLOW_BUDGET_BYTES_S,
        ge=0,
        description="bytes a second all routers together may write of their load windows to a shared store: each "
        "router publishes every load_publish_s while the routers heartbeating there stay within it, less often as "
        "they grow (at most every half load_window_s); 0: no budget",
    )
    heartbeat_s: float = Field(1.0, gt=0, description="how often a router reports the routing-table version it serves")
    hidden_sample_tokens: int = Field(
        0,
        ge=0,
        le=4096,
        description="real hidden states a router keeps per MoE layer (a reservoir, published every load_publish_s) for "
        "the health monitor to probe experts with; 0: none (the monitor probes with seeded inputs)",
    )
    warm_up: bool = Field(
        True,
        description="before reporting ready, run a short warm-up: the router's engine a prefill chunk and a decode "
        "step through its model (no expert group called, nothing counted), each expert group one compute per held "
        "layer at a decode and a prefill size (no statistics recorded); its time is in the log, /health and Describe",
    )
    router_weight_check_s: float = Field(
        300.0,
        ge=0,
        description="how often a router checks its own weights (attention, norms, gates, embeddings, LM head) against "
        "their fingerprints at load, in a thread of its own; a changed tensor makes it not ready, named in /health. "
        "0: only at load and on demand (POST /health/weights)",
    )
    quarantine_fallback: Literal["next_best", "renormalise"] = Field(
        "next_best",
        description="an expert whose every replica is quarantined: the gate picks the next-best expert in its slot, "
        "or its slot is dropped and the token's other experts renormalised",
    )

    @field_validator("router_device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if not DEVICE_NAME.fullmatch(value):
            raise ValueError(DEVICE_NAMES)
        return value

    @model_validator(mode="after")
    def _hedge_delays_in_order(self) -> "DataPlaneConfig":
        if self.hedge_delay_min_s > self.hedge_delay_max_s:
            raise ValueError(
                f"hedge_delay_min_s ({self.hedge_delay_min_s:g}) must not exceed hedge_delay_max_s "
                f"({self.hedge_delay_max_s:g})"
            )
        return self


#: the largest engine step ``max_step_tokens`` may ask for (a step feeds its tokens through the model at once)
MAX_STEP_TOKENS = 65536


class ServingConfig(BaseSettings):
    """The public APIs of a router (``expertmesh up``): gRPC, and OpenAI-compatible HTTP with ``http_port``."""

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    host: str = Field("127.0.0.1", description="address the Inference gRPC server binds")
    port: int = Field(50051, ge=0, le=65535, description="its port (0 picks a free one)")
    max_active_sequences: int = Field(32, ge=1, description="sequences decoded together in one step")
    max_queued_requests: int = Field(128, ge=0, description="requests waiting for a slot; beyond: RESOURCE_EXHAUSTED")
    kv_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="bytes of the KV-cache pool (unset or 0: a quarter of the host's available memory on CPU, within "
        "the container's memory limit, half the device's free memory on a GPU, at most what max_active_sequences "
        "full contexts need)",
    )
    kv_block_size: int = Field(16, ge=1, description="token positions per KV-cache block")
    max_step_tokens: int = Field(
        1024,
        ge=1,
        le=MAX_STEP_TOKENS,
        description="tokens one engine step feeds at most (decoding sequences first; longer prompts are chunked): "
        "larger prefills faster, smaller keeps streams flowing while a long prompt comes in",
    )
    prefix_caching: bool = Field(True, description="share the KV blocks of equal prompt prefixes between requests")
    serial_step_tokens: int = Field(
        64,
        ge=0,
        le=MAX_STEP_TOKENS,
        description="an engine step of at most this many tokens (a decode step of that many sequences) runs the "
        "router's own work on one torch intra-op thread but its large products (the attention projections, the LM "
        "head, the decode attention), which take all of them (local groups' lanes keep theirs): a parallel region "
        "per small op costs more than it saves there, and the idle thread it wakes takes a core from the groups; "
        "0: every step on all of the router's threads",
    )
    default_max_new_tokens: int = Field(64, ge=1, description="when a request does not say")
    max_new_tokens_cap: int = Field(1024, ge=1, description="requests asking for more are refused")
    max_routing_trace_entries: int = Field(
        65536,
        ge=1,
        description="a request asking for a routing trace of more (new tokens x choices x MoE layers) is refused",
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, time in-flight requests get to finish")
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve grpc.health.v1 alone, in plaintext, on this port "
        "(kubelet gRPC probes cannot speak TLS)",
    )
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve the OpenAI-compatible HTTP API, /health and /metrics on this port, on host "
        "(0 picks one; unset: off)",
    )
    http_max_body_bytes: int = Field(
        4 << 20, ge=1024, description="HTTP request bodies larger than this are refused with 413"
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve Prometheus metrics alone on this port (OTLP follows the OTEL_* environment)",
    )
    routing_policy: str = Field(
        "exact",
        description="routing policy of requests that name none, with its parameters if any: a name (exact, prefer, "
        "restrict, delta_gap, dynamic_k, confidence_k, ..., or a+b) or name(param=value,...), e.g. "
        "'restrict+delta_gap(top_n=4,delta=0.2)'",
    )
    domain_routing_policies: Annotated[dict[str, str], NoDecode] = Field(
        {},
        description="per query domain, the routing policy of its requests that name none, in place of "
        "routing_policy (a domain of the classifier's taxonomy, or one level below it; a request without a domain "
        "is classified when any is set): DOMAIN=POLICY;DOMAIN=POLICY in a flag or the environment, e.g. "
        "'legal=restrict(top_n=4);code=confidence_k', a mapping in a config file",
    )
    policy_kl_bound: float = Field(
        0.1,
        ge=0,
        description="refuse a policy whose recorded KL(exact || policy) (`expertmesh policy eval`) is above this, "
        "unless forced",
    )
    profiles: Path | None = Field(
        None,
        description="capability profiles file (`expertmesh profile build --out`) loaded into the state store at start, "
        "for the prefer and restrict policies (unset: those in the store)",
    )
    consistency_guard: str = Field(
        "",
        description="consistency guard of non-exact requests that ask for none: a scorer (self, embedding); empty: off",
    )
    consistency_threshold: float = Field(
        GUARD_THRESHOLD,
        ge=0,
        le=1,
        description="consistency guard: a new token scored below this is computed again, widened",
    )
    consistency_max_regenerations: int = Field(
        GUARD_MAX_REGENERATIONS,
        ge=0,
        le=GUARD_REGENERATIONS_LIMIT,
        description="consistency guard: most tokens computed again per request",
    )

    anomaly_action: AnomalyAction = Field(
        "none",
        description="what the router does on an anomaly (a signal anomaly_sigma standard deviations off its rolling "
        "baseline): none (a warning, the expertmesh_anomaly_active gauge); exact_routing (every request is routed "
        "exactly while a MoE layer's gate confidence is anomalous); health_round (a load-share or gate-confidence "
        "anomaly asks the orchestrator's health monitor for an early round on the implicated experts); or "
        "exact_routing+health_round",
    )
    anomaly_sigma: float = Field(
        3.0,
        gt=0,
        description="standard deviations off the rolling baseline (per step: gate confidence per MoE layer, KV "
        "fragmentation) that make an anomaly",
    )

    @field_validator("domain_routing_policies", mode="before")
    @classmethod
    def _domain_policies(cls, value):
        """``DOMAIN=POLICY;DOMAIN=POLICY`` (flags, the environment) or a mapping (a config file, Helm values)."""
        if isinstance(value, str):
            pairs = [p.strip() for p in value.split(";") if p.strip()]
            bad = [p for p in pairs if "=" not in p.split("(")[0]]
            if bad:
                raise ValueError(f"expected DOMAIN=POLICY;DOMAIN=POLICY, got {bad[0][:64]!r}")
            value = {}
            for domain, policy in (p.split("=", 1) for p in pairs):
                if domain.strip() in value:
                    raise ValueError(f"domain {domain.strip()[:64]!r} is given twice")
                value[domain.strip()] = policy.strip()
        if isinstance(value, dict):
            for domain, policy in value.items():
                if not isinstance(domain, str) or not domain.strip() or not isinstance(policy, str):
                    raise ValueError(f"expected domain -> policy text, got {domain!r}: {policy!r}")
        return value


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

    cert_file: Path | None = Field(
        None, description="PEM certificate chain this process presents, as server and as client"
    )
    key_file: Path | None = Field(None, description="PEM private key of cert_file")
    ca_file: Path | None = Field(
        None, description="PEM CA bundle peers' certificates must chain to (unset: clients trust the system roots)"
    )
    require_client_cert: bool = Field(
        False, description="also require client certificates on the Inference and admin APIs (expert groups always do)"
    )
    group_server_name: str | None = Field(
        None,
        description="name expert-group certificates are issued for; group channels verify it instead of the IP "
        "they dial",
    )

    @model_validator(mode="after")
    def _complete(self) -> "TlsConfig":
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("EXPERTMESH_TLS_CERT_FILE and EXPERTMESH_TLS_KEY_FILE go together: set both or neither")
        if self.require_client_cert and self.ca_file is None:
            raise ValueError(
                "EXPERTMESH_TLS_REQUIRE_CLIENT_CERT needs EXPERTMESH_TLS_CA_FILE, the CA client certificates chain to"
            )
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
    token_file: Path | None = Field(
        None, description="file holding the token (read at start; surrounding whitespace ignored)"
    )
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


class RedisAuthConfig(BaseSettings):
    """How a process authenticates to a Redis state store (``EXPERTMESH_REDIS_*``), read when it opens one.

    A Redis with one user per component (``expertmesh store acl``: routers may read the table, profiles and
    quarantines and write only their heartbeats, load windows and hidden-state samples; expert groups their
    registration; the orchestrator the rest) gives each process its ``username`` and a password, best from
    ``password_file`` (a mounted Secret: never on a command line, nor in the environment). No username: the
    ``default`` user. ``rediss://`` URLs speak TLS, verifying the server against ``ca_file`` (else the
    system roots). Nothing set: no authentication (the tests' loopback redis-server).
    """

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_REDIS_", extra="forbid")

    username: str | None = Field(None, description="Redis ACL user of this process (unset: the default user)")
    password: str | None = Field(None, description="its password; prefer password_file")
    password_file: Path | None = Field(
        None, description="file holding the password (read when the store is opened; surrounding whitespace ignored)"
    )
    ca_file: Path | None = Field(None, description="PEM CA bundle a rediss:// server's certificate must chain to")

    @model_validator(mode="after")
    def _one_password_source(self) -> "RedisAuthConfig":
        if self.password and self.password_file:
            raise ValueError("set EXPERTMESH_REDIS_PASSWORD or EXPERTMESH_REDIS_PASSWORD_FILE, not both")
        return self

    def secret(self) -> str | None:
        """The password, from ``password_file`` when set; InvalidRequest naming the file when it cannot be read."""
        if self.password_file is None:
            return self.password
        try:
            return self.password_file.read_text().strip()
        except OSError as err:
            raise InvalidRequest(
                f"EXPERTMESH_REDIS_PASSWORD_FILE {self.password_file}: cannot read it: {err.strerror}"
            ) from None


class FaultInjectionConfig(BaseSettings):
    """The expert groups' test-only fault hook (``InjectFault``: overwrite an expert's weights in
    place), which the chaos benchmark and tests use to check that the health monitor finds what
    memory faults do. Off unless ``EXPERTMESH_ENABLE_FAULT_INJECTION=1`` is set in the group's
    environment (a router passes it on to the groups it starts, like the TLS settings), so a
    production deployment refuses it even from an admin."""

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid")

    enable_fault_injection: bool = Field(False, description="accept InjectFault (test and chaos runs only)")


# --- where settings come from ------------------------------------------------------------------

S = TypeVar("S", bound=BaseSettings)

#: The settings a config file may hold: every field of these classes (one file serves every command).
FILE_SETTINGS: tuple[type[BaseSettings], ...] = (DataPlaneConfig, ServingConfig)

#: Helm values keys that are also settings, and the field each one sets.
HELM_KEYS: dict[tuple[str, ...], str] = {
    ("model", "path"): "model",
    ("model", "dtype"): "dtype",
    ("router", "port"): "port",
    ("router", "healthPort"): "health_port",
    ("router", "http", "port"): "http_port",
    ("expertGroups", "numCpus"): "group_num_cpus",
    ("redis", "external", "url"): "state_url",
    ("router", "routingPolicy"): "routing_policy",
    ("router", "domainRoutingPolicies"): "domain_routing_policies",
    ("router", "warmUp"): "warm_up",
    ("router", "anomalyAction"): "anomaly_action",
    ("router", "anomalySigma"): "anomaly_sigma",
    ("router", "weightCheckSeconds"): "router_weight_check_s",
}
#: Helm switches: when false, the setting under them stays unset (``router.http.enabled: false``).
HELM_SWITCHES: dict[tuple[str, ...], str] = {("router", "http", "enabled"): "http_port"}


@dataclass(frozen=True)
class ConfigFile:
    """The settings one ``--config`` file gives: ``values`` by field name, ``keys`` as written there."""

    path: Path | None = None
    values: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)


def read_config_file(path: Path | None) -> ConfigFile:
    """Parse a config file into field values; an unreadable file or an unknown key is a ConfigError."""
    if path is None:
        return ConfigFile()
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not YAML: {str(err).splitlines()[0]}") from None
    if document is None:
        return ConfigFile(path)
    if not isinstance(document, dict):
        raise ConfigError(f"config file {path} must be a mapping of settings, not {type(document).__name__}")
    known = {name for settings in FILE_SETTINGS for name in settings.model_fields}
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    switched_off: set[str] = set()

    def walk(mapping: dict, prefix: tuple[str, ...]) -> None:
        for key, value in mapping.items():
            at = (*prefix, str(key))
            if at in HELM_SWITCHES:
                if not value:
                    switched_off.add(HELM_SWITCHES[at])
            elif at in HELM_KEYS:
                values[HELM_KEYS[at]], keys[HELM_KEYS[at]] = value, ".".join(at)
            elif isinstance(value, dict) and any(helm[: len(at)] == at for helm in (*HELM_KEYS, *HELM_SWITCHES)):
                walk(value, at)
            elif not prefix and key in known:
                values[key], keys[key] = value, key
            else:
                raise ConfigError(f"config file {path}: unknown key {'.'.join(at)!r}")

    walk(document, ())
    for name in switched_off:
        values.pop(name, None)
        keys.pop(name, None)
    return ConfigFile(path, values, keys)


def load_settings(
    settings: type[S],
    file: ConfigFile,
    flags: Mapping[str, Any],
    flag_names: Mapping[str, str],
    fallback: Mapping[str, Any] | None = None,
) -> S:
    """``settings`` from its defaults < ``file`` < the environment < ``flags`` (field -> value given);
    ``fallback`` fills fields no source sets (a default only the command line knows, such as the
    embedded model). A bad value is one ConfigError line naming the flag, variable or file key."""
    try:
        env = EnvSettingsSource(settings)()
    except SettingsError as err:
        raise ConfigError(str(err)) from None
    from_file = {k: v for k, v in file.values.items() if k in settings.model_fields and k not in env}
    given = {**from_file, **flags}
    unset = {k: v for k, v in (fallback or {}).items() if k not in given and k not in env}
    try:
        # init arguments outrank the environment in pydantic-settings, so the file's values go
        # in only where the environment is silent
        return settings(**unset, **given)
    except ValidationError as err:
        prefix = settings.model_config.get("env_prefix", "")

        def source(name: str) -> str:
            if name in flags:
                return flag_names.get(name, name)
            if name in env:
                return f"{prefix}{name.upper()}"
            if name in from_file:
                return f"{file.path}: {file.keys[name]}"
            return name

        problems = []
        for e in err.errors():
            message = e["msg"].removeprefix("Value error, ")
            if e["type"] == "missing":
                name = str(e["loc"][0])
                message = f"{flag_names.get(name, name)} is required (or {prefix}{name.upper()}, or {name} in --config)"
            elif e["loc"]:
                shown = e["input"] if isinstance(e["input"], (str, int, float, bool)) else None
                message = f"{source(str(e['loc'][0]))}: {message}" + (f" (got {shown!r})" if shown is not None else "")
            problems.append(message)
        raise ConfigError("; ".join(problems)) from None


def _flag_kind(annotation: Any) -> dict[str, Any]:
    """argparse ``type`` or ``choices`` of a field's annotation (``X | None`` counts as X)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        return {"choices": list(typing.get_args(annotation))}
    if annotation is bool:  # the field's validator reads the word
        return {"choices": ["true", "false"]}
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is dict:  # the field's validator reads the text
        return {"type": str}
    return {"type": annotation}


def add_setting_flag(
    parser: argparse.ArgumentParser,
    settings: type[BaseSettings],
    name: str,
    flag: str | None = None,
    default_note: str | None = None,
) -> None:
    """A flag for one field: unset by default (the other sources then decide), help text from the
    field's description, its default and its environment variable."""
    info = settings.model_fields[name]
    flag = flag or f"--{name.replace('_', '-')}"
    default = default_note or ("unset" if info.default in (None, PydanticUndefined) else str(info.default))
    env = f"{settings.model_config.get('env_prefix', '')}{name.upper()}"
    kind = _flag_kind(info.annotation)
    parser.add_argument(
        flag,
        dest=name,
        default=None,
        metavar=None if "choices" in kind else name.upper(),
        help=f"{info.description} (default: {default}; env {env})",
        **kind,
    )
    # error messages name the flag as the user typed it
    parser.set_defaults(setting_flags={**(parser.get_default("setting_flags") or {}), name: flag})


def settings_from_args(settings: type[S], args: argparse.Namespace, fallback: Mapping[str, Any] | None = None) -> S:
    """``settings`` from ``args``' flags (those given), its ``--config`` file and the environment."""
    given = {name: value for name in settings.model_fields if (value := getattr(args, name, None)) is not None}
    file = read_config_file(getattr(args, "config", None))
    return load_settings(settings, file, given, getattr(args, "setting_flags", None) or {}, fallback)


def add_loop_flag(parser: argparse.ArgumentParser, flag: str, settings: type[BaseSettings], help: str) -> None:
    """A control loop's on-switch (``--drift``, ``--health-monitor``, ``--capacity``): unset unless given, so that
    ``loop_settings`` leaves ``enabled`` to the environment; ``help`` ends with where its settings come from."""
    prefix = settings.model_config.get("env_prefix", "")
    parser.add_argument(flag, action="store_true", default=None, help=f"{help} (settings: {prefix}*)")


def loop_settings(settings: type[S], switched_on: bool) -> S:
    """A control loop's ``settings`` from the environment alone, ``enabled`` when its flag was given
    (``switched_on``); a bad setting is one InvalidRequest line naming its variable."""
    try:
        return settings(**({"enabled": True} if switched_on else {}))
    except ValidationError as err:
        prefix = settings.model_config.get("env_prefix", "")
        problems = (
            f"{prefix}{'_'.join(str(part) for part in e['loc']).upper()}: {e['msg']}" if e["loc"] else e["msg"]
            for e in err.errors()
        )
        raise InvalidRequest("; ".join(p.removeprefix("Value error, ") for p in problems)) from None


def add_guard_arguments(parser: argparse.ArgumentParser) -> None:
    """The consistency guard's knobs, as ``policy eval --guard`` and ``bench serve --guard`` both take them."""
    parser.add_argument(
        "--guard-threshold", type=float, help=f"the guard's threshold, 0-1 (default: {GUARD_THRESHOLD:g})"
    )
    parser.add_argument(
        "--guard-recompute",
        choices=list(GUARD_RECOMPUTE),
        default=GUARD_RECOMPUTE[0],
        help="how the guard computes a token again: widened (top-3, the default) or exact (the stock gate)",
    )


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE.yaml",
        help="settings file (field names, or their Helm values keys); the environment and flags override it "
        "(default: none)",
    )


def add_data_plane_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every command that starts a data plane shares (``up``, ``verify``, benchmarks)."""
    add_config_argument(parser)
    add_setting_flag(parser, DataPlaneConfig, "model", default_note="the embedded tiny model")
    for name in (
        "revision",
        "groups",
        "placement",
        "gpu_placement",
        "topology",
        "group_per",
        "dtype",
        "router_device",
        "ray_address",
        "state_url",
        "deployment",
    ):
        add_setting_flag(parser, DataPlaneConfig, name)


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """``up``'s flags of the router's public APIs (``ServingConfig``)."""
    add_setting_flag(parser, ServingConfig, "host")
    add_setting_flag(parser, ServingConfig, "port")
    add_setting_flag(parser, ServingConfig, "max_active_sequences", "--max-active")
    add_setting_flag(parser, ServingConfig, "max_queued_requests", "--max-queued")
    add_setting_flag(parser, ServingConfig, "kv_cache_bytes")
    add_setting_flag(parser, ServingConfig, "kv_block_size")
    add_setting_flag(parser, ServingConfig, "max_step_tokens")
    add_setting_flag(parser, ServingConfig, "serial_step_tokens")
    add_setting_flag(parser, ServingConfig, "prefix_caching")
    add_setting_flag(parser, ServingConfig, "default_max_new_tokens")
    add_setting_flag(parser, ServingConfig, "max_new_tokens_cap")
    add_setting_flag(parser, ServingConfig, "max_routing_trace_entries")
    add_setting_flag(parser, ServingConfig, "drain_timeout_s", "--drain-timeout")
    add_setting_flag(parser, ServingConfig, "health_port")
    add_setting_flag(parser, ServingConfig, "http_port")
    add_setting_flag(parser, ServingConfig, "http_max_body_bytes")
    add_setting_flag(parser, ServingConfig, "metrics_port")
    add_setting_flag(parser, ServingConfig, "routing_policy")
    add_setting_flag(parser, ServingConfig, "domain_routing_policies")
    add_setting_flag(parser, ServingConfig, "profiles")
    add_setting_flag(parser, ServingConfig, "consistency_guard")
    add_setting_flag(parser, ServingConfig, "consistency_threshold")
    add_setting_flag(parser, ServingConfig, "consistency_max_regenerations")
    add_setting_flag(parser, ServingConfig, "anomaly_action")
    add_setting_flag(parser, ServingConfig, "anomaly_sigma")
