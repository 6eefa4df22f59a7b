"""What the health monitor measures, remembers and decides about each replica:
plain data, no I/O (the glossary is in the package docstring).

Records persist as JSON bytes in the state store's ``health`` hash (the data
plane's store module does not import the orchestrator, so (de)serialising is
done here: ``save`` / ``load_all`` / ``remove``). What routers need, the set of
replicas that must receive no tokens, is published separately in the store's
``quarantine`` hash (``expertmesh.store.QuarantinedReplica``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from enum import StrEnum

from expertmesh.store import StateStore, replica_key

Pair = tuple[int, int]

#: transitions a record keeps (the oldest are dropped)
HISTORY = 32


class HealthState(StrEnum):
    """healthy -> suspect -> quarantined -> probation -> healthy (``policy`` has the rules)."""

    HEALTHY = "healthy"
    SUSPECT = "suspect"
    QUARANTINED = "quarantined"
    PROBATION = "probation"

    @property
    def out_of_service(self) -> bool:
        """Routers must send it no tokens."""
        return self in (HealthState.QUARANTINED, HealthState.PROBATION)


class Initiator(StrEnum):
    """Who quarantined a replica: the monitor repairs its own quarantines, the others wait for ``release``."""

    MONITOR = "monitor"
    OPERATOR = "operator"
    #: an ExpertQuarantine object (``orchestrator.kube.quarantine``): released when the object is deleted
    KUBERNETES = "kubernetes"


@dataclass(frozen=True, order=True)
class ReplicaId:
    layer: int
    expert: int
    group: str

    @property
    def pair(self) -> Pair:
        return (self.layer, self.expert)

    @property
    def key(self) -> str:
        return replica_key(self.layer, self.expert, self.group)

    def describe(self) -> str:
        return f"layer {self.layer} expert {self.expert} on {self.group}"


# -- measured --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """Counts over bins: bin 0 holds values <= edges[0], bin i values in (edges[i-1], edges[i]],
    the last values > edges[-1]; len(counts) == len(edges) + 1."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Baseline:
    """A replica's probe output when it was loaded (or repaired) and verified: what later checks compare with."""

    taken_at: float
    #: the replica's load-time weight fingerprint; weights loaded anew with another one need a new baseline
    fingerprint: str
    norm_mean: float
    #: L2 norms of the output rows, on bins at the baseline's own quantiles
    norms: Histogram
    #: output values (a fixed subsample), likewise
    activations: Histogram
    #: digest of the probe input it was taken on (``probes.Probe.digest``); another input needs another baseline
    probe: str = ""


@dataclass(frozen=True)
class Check:
    """One check of one replica: the probe's figures and what its group reported."""

    at: float
    #: the weight fingerprint taken at load, and whether recomputing it now gives the same
    fingerprint: str
    fingerprint_intact: bool
    #: the probe input: its digest, and "recorded" (routers' hidden states) or "seeded" (the fallback)
    probe: str
    probe_source: str
    #: probe output rows with a NaN or an Inf
    probe_non_finite: int
    #: Describe's count of output rows with a NaN or an Inf since the expert was loaded (served
    #: traffic; the probes' rows count there too, being Dispatch calls like any other)
    served_non_finite: int
    norm_mean: float
    #: max of the norm and activation KL(baseline || now); None without a (current) baseline
    kl: float | None
    #: the baseline this probe would make; None when the replica has a current one (it would not be used)
    candidate: Baseline | None
    #: max relative distance of the output norms from the median over the expert's replicas; None with one
    deviation: float | None
    #: replicas of the expert checked this round
    replicas: int


# -- decided ---------------------------------------------------------------------------------


class FindingKind(StrEnum):
    FINGERPRINT = "fingerprint"
    PROBE_NON_FINITE = "probe_non_finite"
    SERVED_NON_FINITE = "served_non_finite"
    DIVERGENCE = "divergence"
    MEAN_SHIFT = "mean_shift"
    REPLICA_MISMATCH = "replica_mismatch"


class Severity(StrEnum):
    #: recorded and reported, never a state change by itself: evidence that any caller's input can produce
    NOTICE = "notice"
    #: watch it: quarantined only if it lasts ``suspect_checks`` checks
    SUSPECT = "suspect"
    #: evidence enough to stop its traffic now
    QUARANTINE = "quarantine"


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    severity: Severity
    #: one line with the figures
    detail: str


# -- remembered ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transition:
    state: HealthState
    at: float
    reason: str


@dataclass(frozen=True)
class ReplicaRecord:
    """The monitor's memory of one replica, saved after every change."""

    replica: ReplicaId
    state: HealthState = HealthState.HEALTHY
    #: why it is in ``state``, one line
    reason: str = ""
    #: wall-clock seconds it entered ``state``
    since: float = 0.0
    #: who quarantined it (QUARANTINED, and PROBATION after it)
    quarantined_by: Initiator | None = None
    #: checks in a row with findings, while SUSPECT
    suspect_checks: int = 0
    #: clean checks since PROBATION began
    clean_checks: int = 0
    #: the monitor took the group out of the routing table for this expert; it goes back once HEALTHY
    withdrawn: bool = False
    baseline: Baseline | None = None
    #: wall-clock seconds of the last check; 0 = never
    last_check: float = 0.0
    kl: float | None = None
    norm_mean: float | None = None
    #: Describe's served non-finite row count at the last check, to tell new ones from old
    non_finite_seen: int = 0
    #: what the last check probed with: "recorded" hidden states of real traffic, or "seeded" ones (the fallback)
    probe_source: str = ""
    repairs: int = 0
    history: tuple[Transition, ...] = ()

    def entering(self, state: HealthState, at: float, reason: str, **changes) -> ReplicaRecord:
        """This record moved to ``state`` at ``at`` for ``reason``, with ``changes`` to other fields."""
        history = (*self.history, Transition(state, at, reason))[-HISTORY:]
        return replace(self, state=state, since=at, reason=reason, history=history, **changes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ReplicaRecord:
        d = json.loads(text)
        return cls(
            **{
                **d,
                "replica": ReplicaId(**d["replica"]),
                "state": HealthState(d["state"]),
                "quarantined_by": Initiator(d["quarantined_by"]) if d["quarantined_by"] else None,
                "baseline": _baseline_from_dict(d["baseline"]) if d["baseline"] else None,
                "history": tuple(Transition(HealthState(t["state"]), t["at"], t["reason"]) for t in d["history"]),
            }
        )


def _histogram(d: dict) -> Histogram:
    return Histogram(tuple(d["edges"]), tuple(d["counts"]))


def _baseline_from_dict(d: dict) -> Baseline:
    return Baseline(
        taken_at=d["taken_at"],
        fingerprint=d["fingerprint"],
        norm_mean=d["norm_mean"],
        norms=_histogram(d["norms"]),
        activations=_histogram(d["activations"]),
        probe=d.get("probe", ""),
    )


# -- the store -------------------------------------------------------------------------------


def save(store: StateStore, record: ReplicaRecord) -> None:
    store.save_health_record(record.replica.key, record.to_json().encode())


def remove(store: StateStore, replica: ReplicaId) -> None:
    store.remove_health_record(replica.key)


def load_all(store: StateStore) -> dict[ReplicaId, ReplicaRecord]:
    records = (ReplicaRecord.from_json(raw) for raw in store.health_records().values())
    return {r.replica: r for r in records}
