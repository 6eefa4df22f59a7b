"""The state store: routing table, group endpoints (and later load windows and
health), shared by routers, expert groups and the orchestrator.

``open_store(url)`` picks a backend: ``memory://`` (in-process, the embedded
default) or ``redis://host:port/db`` (a cluster). ``StateStore`` is the typed
face every component uses; backends only implement a handful of key-value
primitives (``KeyValueBackend``), so both behave the same by construction.

Keys (all under the ``expertmesh:<deployment>:`` prefix, one namespace per deployment: ``--deployment``
or ``EXPERTMESH_DEPLOYMENT``, default ``default``; a routing table also names its model, and a store
refuses to publish one model's table over another's, ``StoreCollision``):
- ``routing_table``         JSON of the current RoutingTable
- ``routing_table:version`` its version alone, so routers poll cheaply
- ``placement``             hash: ``digest`` -> the placement file last applied to the table
- ``endpoints``             hash: group name -> "host:port" of its gRPC server
- ``load``                  hash: router id -> the load of its window (a ``contracts.load_report`` pulse, .npz
  bytes), rewritten every ``load_publish_s`` (longer in a fleet past its inflow budget); the orchestrator deletes
  a router's record (and its detail) once stale
- ``load_detail``           hash: router id -> its whole load window (``LoadSnapshot.to_bytes``), rewritten every
  ``load_report.DETAIL_EVERY`` pulses
- ``routers``               hash: router id -> JSON ``RouterHeartbeat`` (the routing-table version
  it serves and when it last said so); migrations drain on it
- ``migrations``            hash: migration id -> the orchestrator's JSON migration record
  (``expertmesh.orchestrator.migration.state``; opaque here); finished ones deleted after a while
  (``expertmesh.orchestrator.retention``)
- ``groups``                hash: group name -> the orchestrator's JSON record of its last add or remove
  (``expertmesh.orchestrator.elastic.state``; opaque here); stopped ones deleted as migrations are
- ``quarantine``            hash: ``"<layer>/<expert>/<group>"`` -> JSON ``QuarantinedReplica``: the
  replicas that must not receive tokens (the health monitor quarantined them, or
  has them on probation after a repair); routers read it
- ``profiles``              hash: domain -> JSON capability profile (``expertmesh.router.policy.profiles``)
- ``policy_quality``        hash: routing policy -> JSON of its last ``expertmesh policy eval``
- ``health``                hash: ``"<layer>/<expert>/<group>"`` -> the health monitor's JSON record of
  that replica (``expertmesh.orchestrator.health.state``; opaque here)
- ``hidden_samples:<layer>`` hash: router id -> a sample of the real hidden states that reached the MoE
  layer (``state.samples`` bytes [rows, H], ``router.hidden_sample``); the health monitor probes with it
- ``health_probes``         hash: layer -> the probe input the health monitor pinned for it
  (``expertmesh.orchestrator.health.probes``; opaque here)
- ``anomalies``             hash: router id -> JSON list of its latest ``AnomalyRecord``s (the router keeps the
  last few and rewrites its field whole); the health monitor runs an early round on the experts they name

Who may read and write each key is declared once, in ``store.access.LAYOUT``; a Redis gives each component a
user with exactly those rights (``expertmesh store acl``), and the store refuses a key the layout lacks.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Protocol

from expertmesh.contracts.errors import StoreCollision
from expertmesh.contracts.routing_table import MalformedTable, RoutingTable
from expertmesh.store.access import declared

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterHeartbeat:
    """What one router last reported: the routing-table version its steps use now."""

    router_id: str
    table_version: int
    #: wall-clock seconds (time.time()) of the report; a router silent for long is presumed gone
    at: float


@dataclass(frozen=True)
class QuarantinedReplica:
    """One replica of a (layer, expert) that must receive no tokens.

    Routers serve a token that chose (layer, expert) from the table's replicas of it
    minus the groups quarantined for it. ``withdrawn`` says which case this is: True,
    the routing table no longer lists the group for the expert and healthy replicas
    serve it (no quality change); False, the table still lists it because no healthy
    replica is left (a table never leaves an expert unhosted), so when every listed
    replica is quarantined the router falls back for that expert (next-best expert
    in the slot, or renormalise over the rest of the top-k) and marks the request degraded.
    """

    layer: int
    expert: int
    group: str
    #: "quarantined", or "probation" (repaired, being re-checked before it serves again)
    state: str
    #: one line: why it was quarantined
    reason: str
    #: wall-clock seconds it entered ``state``
    since: float
    withdrawn: bool

    @property
    def key(self) -> str:
        return replica_key(self.layer, self.expert, self.group)


@dataclass(frozen=True)
class AnomalyRecord:
    """An anomaly a router's monitor started (``router.reporting.anomaly_monitor``), as it asks the health monitor
    for an early round on the experts it implicates.

    Example: ``AnomalyRecord("r1", 3, "load_share", 1, ((1, 2),), 1.7e9, 0.61, 0.25, 0.02, 3.0)``: router r1's third
    record, layer 1 expert 2 took 61% of the layer's tokens against a baseline of 25% ± 2%.
    """

    router_id: str
    #: the router's count of its records, from 1; the health monitor acts on each (router, seq) once
    seq: int
    #: "load_share", "gate_confidence" or "gate_margin"
    signal: str
    #: the MoE layer (the model's layer index, as the routing table's)
    layer: int
    #: (layer, expert) pairs implicated: the experts whose load share left its baseline; for a gate-confidence
    #: anomaly the layer's experts (the most loaded ones, capped)
    pairs: tuple[tuple[int, int], ...]
    #: wall-clock seconds (time.time()) the anomaly started
    at: float
    value: float
    mean: float
    std: float
    sigma: float

    def describe(self) -> str:
        """One line: which router saw what."""
        return (
            f"router {self.router_id}: {self.signal} of layer {self.layer} = {self.value:.4g}, off its baseline "
            f"{self.mean:.4g} ± {self.sigma:g} × {self.std:.4g}"
        )


def _record(cls, raw: bytes, key: str, field_name: str):
    """``cls`` from its stored JSON, ignoring fields this version does not know (a newer writer's); None,
    logged, for a record that cannot be read (one bad record must not hide the others)."""
    try:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
    except (ValueError, TypeError, AttributeError) as err:
        log.warning("skipping unreadable %s record %r: %s", key, field_name[:64], err)
        return None


def replica_key(layer: int, expert: int, group: str) -> str:
    """The hash field of one replica in ``quarantine`` and ``health``."""
    return f"{layer}/{expert}/{group}"


class KeyValueBackend(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def compare_and_set_many(self, guard_key: str, expected: bytes | None, items: dict[str, bytes]) -> bool:
        """Write ``items`` atomically if ``guard_key`` still holds ``expected``."""
        ...

    def hset(self, key: str, field: str, value: bytes) -> None: ...

    def hdel(self, key: str, field: str) -> None: ...

    def hgetall(self, key: str) -> dict[str, bytes]: ...

    def hget(self, key: str, field: str) -> bytes | None: ...

    def hlen(self, key: str) -> int: ...

    def close(self) -> None: ...


class StateStore:
    def __init__(self, backend: KeyValueBackend, namespace: str = "expertmesh"):
        self._kv = backend
        self._ns = namespace

    @property
    def namespace(self) -> str:
        """The prefix of this deployment's keys, ``expertmesh:<deployment>``."""
        return self._ns

    def _key(self, name: str) -> str:
        declared(name)  # every key is in the layout the Redis users' rights derive from
        return f"{self._ns}:{name}"

    # -- routing table -------------------------------------------------------------

    def routing_table_version(self) -> int:
        raw = self._kv.get(self._key("routing_table:version"))
        return int(raw) if raw is not None else 0

    def routing_table(self) -> RoutingTable | None:
        raw = self._kv.get(self._key("routing_table"))
        return RoutingTable.from_json(raw) if raw is not None else None

    def publish_routing_table(self, table: RoutingTable) -> bool:
        """Store ``table`` if it is the next version after the stored one, or, in an empty store (new or
        flushed), any version: a writer that remembers a later version restores it, so versions routers
        have seen never come back.

        Returns False, writing nothing, when another writer got there first: the
        caller re-reads and re-plans, as a Kubernetes controller does on conflict.
        """
        current = self.routing_table_version()
        if table.version != current + 1 and not (current == 0 and table.version > 0):
            return False
        self._check_same_model(table)
        expected = str(current).encode() if current else None
        return self._kv.compare_and_set_many(
            self._key("routing_table:version"),
            expected,
            {
                self._key("routing_table"): table.to_json().encode(),
                self._key("routing_table:version"): str(table.version).encode(),
            },
        )

    def _check_same_model(self, table: RoutingTable) -> None:
        """Raise StoreCollision when the stored table is another model's: a second deployment writing into
        this one's keys. A table without a model identity (or an unreadable one) is anybody's to replace."""
        try:
            stored = self.routing_table()
        except MalformedTable:
            return
        if stored is None or stored.model is None or table.model is None:
            return
        differences = stored.model.differences(table.model)
        if differences:
            raise StoreCollision(
                f"the state store's routing table under {self._ns}: is another model's ({'; '.join(differences)}): "
                "another deployment uses these keys; give each deployment its own --deployment (EXPERTMESH_DEPLOYMENT)"
            )

    def placement_digest(self) -> str | None:
        """Digest of the placement file the orchestrator last applied (it re-applies only a changed file)."""
        raw = self._kv.hgetall(self._key("placement")).get("digest")
        return raw.decode() if raw is not None else None

    def set_placement_digest(self, digest: str) -> None:
        self._kv.hset(self._key("placement"), "digest", digest.encode())

    # -- endpoints -----------------------------------------------------------------

    def set_endpoint(self, group: str, address: str) -> None:
        self._kv.hset(self._key("endpoints"), group, address.encode())

    def remove_endpoint(self, group: str) -> None:
        self._kv.hdel(self._key("endpoints"), group)

    def endpoints(self) -> dict[str, str]:
        return {g: a.decode() for g, a in self._kv.hgetall(self._key("endpoints")).items()}

    # -- load windows ----------------------------------------------------------------

    def publish_load(self, router_id: str, data: bytes) -> None:
        self._kv.hset(self._key("load"), router_id, data)

    def loads(self) -> dict[str, bytes]:
        """router id -> its latest pulse (``load_report.summed_pulses`` adds them up)."""
        return self._kv.hgetall(self._key("load"))

    def remove_load(self, router_id: str) -> None:
        """A router's pulse and detail gone (the orchestrator's retention, once the router is gone)."""
        self._kv.hdel(self._key("load"), router_id)
        self._kv.hdel(self._key("load_detail"), router_id)

    def publish_load_detail(self, router_id: str, data: bytes) -> None:
        self._kv.hset(self._key("load_detail"), router_id, data)

    def load_details(self) -> dict[str, bytes]:
        """router id -> its latest detail (``load_report.summed_details`` adds them up)."""
        return self._kv.hgetall(self._key("load_detail"))

    # -- router heartbeats ------------------------------------------------------------

    def publish_router_heartbeat(self, beat: RouterHeartbeat) -> None:
        self._kv.hset(self._key("routers"), beat.router_id, json.dumps(asdict(beat)).encode())

    def remove_router_heartbeat(self, router_id: str) -> None:
        self._kv.hdel(self._key("routers"), router_id)

    def router_count(self) -> int:
        """Routers with a heartbeat here (a router that crashed counts until its record is cleared): what each
        router spaces its load publishes by (``load_report.publish_interval_s``)."""
        return self._kv.hlen(self._key("routers"))

    def router_heartbeats(self) -> dict[str, RouterHeartbeat]:
        records = (
            (rid, _record(RouterHeartbeat, raw, "routers", rid))
            for rid, raw in self._kv.hgetall(self._key("routers")).items()
        )
        return {rid: beat for rid, beat in records if beat is not None}

    # -- migrations -------------------------------------------------------------------
    # Records are opaque bytes: the orchestrator owns their format, and the data plane
    # does not import the orchestrator.

    def save_migration(self, migration_id: str, record: bytes) -> None:
        self._kv.hset(self._key("migrations"), migration_id, record)

    def remove_migration(self, migration_id: str) -> None:
        """A finished migration's record gone (the orchestrator's retention, once it is old enough)."""
        self._kv.hdel(self._key("migrations"), migration_id)

    def migration(self, migration_id: str) -> bytes | None:
        return self._kv.hget(self._key("migrations"), migration_id)

    def migrations(self) -> dict[str, bytes]:
        """migration id -> record, every migration this deployment has run or is running."""
        return self._kv.hgetall(self._key("migrations"))

    # -- expert group records ---------------------------------------------------------
    # Opaque bytes, like migrations: the orchestrator's group changes (orchestrator.elastic), kept so that a
    # restarted orchestrator finishes a change it left half done.

    def save_group_record(self, name: str, record: bytes) -> None:
        self._kv.hset(self._key("groups"), name, record)

    def remove_group_record(self, name: str) -> None:
        """A stopped group's record gone (the orchestrator's retention, once it is old enough)."""
        self._kv.hdel(self._key("groups"), name)

    def group_records(self) -> dict[str, bytes]:
        """group name -> its record, every group added or removed through the orchestrator."""
        return self._kv.hgetall(self._key("groups"))

    # -- quarantine ------------------------------------------------------------------
    # Written by the orchestrator's health monitor, read by routers.

    def set_quarantined(self, replica: QuarantinedReplica) -> None:
        self._kv.hset(self._key("quarantine"), replica.key, json.dumps(asdict(replica)).encode())

    def clear_quarantined(self, layer: int, expert: int, group: str) -> None:
        self._kv.hdel(self._key("quarantine"), replica_key(layer, expert, group))

    def quarantined(self) -> dict[tuple[int, int, str], QuarantinedReplica]:
        """(layer, expert, group) -> its entry, for every replica that must receive no tokens."""
        raw = self._kv.hgetall(self._key("quarantine"))
        entries = (_record(QuarantinedReplica, value, "quarantine", key) for key, value in raw.items())
        return {(q.layer, q.expert, q.group): q for q in entries if q is not None}

    # -- health records -----------------------------------------------------------------
    # Opaque bytes, like migrations: the orchestrator owns their format.

    def save_health_record(self, key: str, record: bytes) -> None:
        self._kv.hset(self._key("health"), key, record)

    def remove_health_record(self, key: str) -> None:
        self._kv.hdel(self._key("health"), key)

    def health_records(self) -> dict[str, bytes]:
        return self._kv.hgetall(self._key("health"))

    # -- hidden-state samples ------------------------------------------------------------
    # Written by routers (when sampling is on), read by the health monitor.

    def publish_hidden_sample(self, layer: int, router_id: str, sample: bytes) -> None:
        self._kv.hset(self._key(f"hidden_samples:{layer}"), router_id, sample)

    def hidden_samples(self, layer: int) -> dict[str, bytes]:
        """router id -> its latest sample of ``layer``'s hidden states."""
        return self._kv.hgetall(self._key(f"hidden_samples:{layer}"))

    def remove_hidden_samples(self, router_id: str, layers) -> None:
        for layer in layers:
            self._kv.hdel(self._key(f"hidden_samples:{layer}"), router_id)

    def save_health_probe(self, layer: int, probe: bytes) -> None:
        self._kv.hset(self._key("health_probes"), str(layer), probe)

    def health_probes(self) -> dict[str, bytes]:
        return self._kv.hgetall(self._key("health_probes"))

    # -- anomaly records ---------------------------------------------------------------------
    # Written by routers (anomaly_action health_round), read by the health monitor.

    def publish_anomalies(self, router_id: str, records) -> None:
        """``router_id``'s latest ``AnomalyRecord``s, replacing those it published before."""
        self._kv.hset(self._key("anomalies"), router_id, json.dumps([asdict(r) for r in records]).encode())

    def remove_anomalies(self, router_id: str) -> None:
        """A router's anomaly records gone (the orchestrator's, once the router is gone)."""
        self._kv.hdel(self._key("anomalies"), router_id)

    def anomalies(self) -> list[AnomalyRecord]:
        """Every router's published anomaly records (an unreadable one skipped, logged), by router then seq."""
        out = []
        for router, raw in sorted(self._kv.hgetall(self._key("anomalies")).items()):
            try:
                items = json.loads(raw)
                if not isinstance(items, list):
                    raise ValueError("not a list")
            except ValueError as err:
                log.warning("skipping unreadable anomalies record %r: %s", router[:64], err)
                continue
            for item in items:
                record = _record(AnomalyRecord, json.dumps(item).encode(), "anomalies", router)
                if record is None:
                    continue
                try:
                    pairs = tuple((int(layer), int(expert)) for layer, expert in record.pairs)
                except (TypeError, ValueError) as err:
                    log.warning("skipping an anomaly record of %r with bad pairs: %s", router[:64], err)
                    continue
                out.append(replace(record, pairs=pairs))
        return sorted(out, key=lambda r: (r.router_id, r.seq))

    # -- routing-policy data ---------------------------------------------------------------
    # Written by `expertmesh profile build` and `expertmesh policy eval`, read by routers.

    def save_profile(self, domain: str, record: bytes) -> None:
        self._kv.hset(self._key("profiles"), domain, record)

    def profiles(self) -> dict[str, bytes]:
        """domain -> its capability profile (``expertmesh.router.policy.profiles``; opaque here)."""
        return self._kv.hgetall(self._key("profiles"))

    def save_policy_quality(self, policy: str, record: bytes) -> None:
        self._kv.hset(self._key("policy_quality"), policy, record)

    def policy_quality(self) -> dict[str, bytes]:
        """policy (name and parameters) -> its recorded evaluation (``expertmesh.router.policy_eval``)."""
        return self._kv.hgetall(self._key("policy_quality"))

    def close(self) -> None:
        self._kv.close()


#: what a deployment name may be (``DataPlaneConfig.deployment``)
DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def namespace_of(deployment: str | None = None) -> str:
    """The key prefix of ``deployment`` (None: ``EXPERTMESH_DEPLOYMENT``, else "default"): ``expertmesh:<name>``."""
    deployment = deployment or os.environ.get("EXPERTMESH_DEPLOYMENT") or "default"
    if not DEPLOYMENT_NAME.fullmatch(deployment):
        raise ValueError(
            f"deployment name {deployment[:64]!r}: up to 63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return f"expertmesh:{deployment}"


def open_store(url: str = "memory://", deployment: str | None = None, redis_auth=None) -> StateStore:
    """The store at ``url``, under ``deployment``'s keys (None: ``EXPERTMESH_DEPLOYMENT``, else "default").
    ``redis_auth``: a ``RedisAuthConfig`` (None: the environment's ``EXPERTMESH_REDIS_*``)."""
    namespace = namespace_of(deployment)
    if url.startswith("memory://"):
        from expertmesh.store._memory import MemoryBackend

        return StateStore(MemoryBackend(), namespace)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from expertmesh.config.settings import RedisAuthConfig
        from expertmesh.infra.security import from_env
        from expertmesh.store._redis import RedisBackend

        auth = redis_auth if redis_auth is not None else from_env(RedisAuthConfig)
        return StateStore(RedisBackend(url, auth), namespace)
    raise ValueError(f"unknown state store URL {url!r}; use memory:// or redis://host:port/db")
