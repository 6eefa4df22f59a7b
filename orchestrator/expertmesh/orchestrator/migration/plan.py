"""The migration protocol as pure functions: phase order, routing-table edits
that never leave a pair unhosted, when a replica is drained, and when a canary
passes. No I/O; the executor calls these with what it observed."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from expertmesh.contracts.errors import InvalidRequest, MigrationRefused
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.migration.state import Migration, MigrationMode, Phase
from expertmesh.store import RouterHeartbeat

Pair = tuple[int, int]

# -- requests ----------------------------------------------------------------------------


def checked_request(
    layer: int,
    expert: int,
    target: str | None,
    source: str | None,
    mode: MigrationMode | str,
    table: RoutingTable | None,
    endpoints: Collection[str],
    quarantined: Collection[tuple[int, int, str]],
    busy: Sequence[Migration],
    id_taken: bool = False,
    migration_id: str | None = None,
) -> tuple[MigrationMode, str]:
    """A migration request checked against what the store holds: the routing table, the groups' endpoints,
    the quarantined replicas (layer, expert, group), the pair's unfinished migrations (``busy``) and whether
    the record's id is taken. Returns its mode and source (without ``source``: the pair's only replica, or
    its first for a replicate). Raises InvalidRequest (the request is wrong) or MigrationRefused (it is
    right, but cannot run now)."""
    try:
        mode = MigrationMode(mode)
    except ValueError:
        raise InvalidRequest(
            f"unknown migration mode {mode!r}; use {', '.join(m.value for m in MigrationMode)}"
        ) from None
    pair = (layer, expert)
    if table is None:
        raise MigrationRefused("no routing table in the state store yet; start the expert groups first")
    if pair not in table.replicas:
        raise MigrationRefused(f"layer {layer} expert {expert} is not in routing table v{table.version}")
    replicas = table.replicas[pair]
    for group in (source, target):
        if group is not None and group not in endpoints:
            raise InvalidRequest(f"unknown group {group!r}; the state store lists {sorted(endpoints)}")
    if source is None:
        if len(replicas) > 1 and mode is not MigrationMode.REPLICATE:
            raise InvalidRequest(
                f"layer {layer} expert {expert} has {len(replicas)} replicas {list(replicas)}; name the source"
            )
        source = replicas[0]
    if source not in replicas:
        raise MigrationRefused(
            f"group {source!r} does not serve layer {layer} expert {expert} (replicas: {list(replicas)})"
        )
    if mode is MigrationMode.EVICT:
        if target is not None:
            raise InvalidRequest("an evict removes a replica and takes no target")
        if len(replicas) == 1:
            raise MigrationRefused(
                f"{source!r} holds the only replica of layer {layer} expert {expert}; every expert needs one "
                "(move it instead)"
            )
    else:
        if target is None:
            raise InvalidRequest(f"a {mode} needs a target group")
        if target in replicas:
            raise MigrationRefused(f"group {target!r} already serves layer {layer} expert {expert}")
        if (layer, expert, target) in quarantined:
            raise MigrationRefused(
                f"group {target!r} holds a quarantined copy of layer {layer} expert {expert}; "
                "`expertmesh release` it first"
            )
    if id_taken:
        raise MigrationRefused(f"migration {migration_id} exists already")
    if busy:
        raise MigrationRefused(f"{busy[0].describe()} is still {busy[0].phase}; one migration per expert at a time")
    return mode, source


# -- phases ------------------------------------------------------------------------------

PHASES: dict[MigrationMode, tuple[Phase, ...]] = {
    MigrationMode.MOVE: (
        Phase.PENDING,
        Phase.LOADING,
        Phase.CHECKING,
        Phase.SWITCHING,
        Phase.CONFIRMING,
        Phase.RETIRING,
        Phase.DRAINING,
        Phase.UNLOADING,
        Phase.SUCCEEDED,
    ),
    MigrationMode.REPLICATE: (Phase.PENDING, Phase.LOADING, Phase.CHECKING, Phase.SWITCHING, Phase.SUCCEEDED),
    MigrationMode.EVICT: (Phase.PENDING, Phase.RETIRING, Phase.DRAINING, Phase.UNLOADING, Phase.SUCCEEDED),
}


def next_phase(mode: MigrationMode, phase: Phase) -> Phase:
    order = PHASES[mode]
    if phase.terminal or phase not in order:
        raise ValueError(f"a {mode} migration has no phase after {phase}")
    return order[order.index(phase) + 1]


def table_touched(
    mode: MigrationMode, phase: Phase, replicas: tuple[str, ...], source: str, target: str | None
) -> bool:
    """Whether a migration in ``phase`` may have published its first table edit, given the pair's
    ``replicas`` now: past that edit's phase, or in it with the edit visible in the table."""
    order = PHASES[mode]
    first_edit = Phase.RETIRING if mode is MigrationMode.EVICT else Phase.SWITCHING
    if order.index(phase) > order.index(first_edit):
        return True
    if phase is not first_edit:
        return False
    return source not in replicas if mode is MigrationMode.EVICT else target in replicas


# -- routing-table edits -------------------------------------------------------------------


def _replicas_of(table: RoutingTable, pair: Pair) -> tuple[str, ...]:
    if pair not in table.replicas:
        raise MigrationRefused(f"layer {pair[0]} expert {pair[1]} is not in routing table v{table.version}")
    return table.replicas[pair]


def with_replicas(
    table: RoutingTable, pair: Pair, replicas: tuple[str, ...], shares: tuple[float, ...] = ()
) -> RoutingTable | None:
    """The next version with ``pair`` served by ``replicas`` (explicit ``shares``, or equal ones
    when empty); None when the table already says exactly that. Never leaves the pair unhosted."""
    if not replicas:
        raise MigrationRefused(f"layer {pair[0]} expert {pair[1]} would have no replica left; every expert needs one")
    if shares and len(shares) != len(replicas):
        raise ValueError(f"{len(shares)} shares for {len(replicas)} replicas")
    if table.replicas.get(pair) == replicas and table.shares.get(pair, ()) == shares:
        return None
    new_shares = {p: s for p, s in table.shares.items() if p != pair}
    if shares and len(replicas) > 1:
        new_shares[pair] = shares
    return replace(table, version=table.version + 1, replicas={**table.replicas, pair: replicas}, shares=new_shares)


def add_replica(table: RoutingTable, pair: Pair, group: str) -> RoutingTable | None:
    """The make edit: ``group`` joins the pair's replicas, shares equal; None if it is listed already."""
    replicas = _replicas_of(table, pair)
    return None if group in replicas else with_replicas(table, pair, (*replicas, group))


def remove_replica(table: RoutingTable, pair: Pair, group: str) -> RoutingTable | None:
    """The break edit: ``group`` leaves the pair's replicas, shares equal; None if it is not listed.
    Refused when it is the last replica."""
    replicas = _replicas_of(table, pair)
    if group not in replicas:
        return None
    return with_replicas(table, pair, tuple(g for g in replicas if g != group))


def check_all_hosted(before: RoutingTable, after: RoutingTable) -> None:
    """Refuse a table that drops a pair ``before`` served or leaves one with no replica."""
    lost = sorted(
        {p for p in before.replicas if not after.replicas.get(p)} | {p for p, g in after.replicas.items() if not g}
    )
    if lost:
        raise MigrationRefused(
            f"routing table v{after.version} would leave (layer, expert) {lost[:5]} without a replica"
        )


def repaired_replicas(
    current: tuple[str, ...],
    before: tuple[str, ...],
    source: str,
    source_holds: bool,
    target: str | None,
    target_holds: bool,
) -> tuple[str, ...]:
    """A failed migration's pair entry after the switch: list the source again if it still holds
    the expert, drop the target if it lost it (unless it is the only replica); the replicas of
    ``before`` keep their order first."""
    keep = list(current)
    if source_holds and source not in keep:
        keep.append(source)
    if target is not None and not target_holds and target in keep and len(keep) > 1:
        keep.remove(target)
    ordered = [g for g in before if g in keep] + [g for g in keep if g not in before]
    return tuple(ordered)


# -- draining ------------------------------------------------------------------------------


@dataclass(frozen=True)
class InFlightCalls:
    """Dispatch calls for the migrating pair executing now on the replica being drained."""

    table_version: int
    calls: int


def drain_ready(
    heartbeats: Iterable[RouterHeartbeat],
    now: float,
    version: int,
    in_flight: Iterable[InFlightCalls],
    liveness_s: float,
) -> tuple[bool, str]:
    """Whether ``version`` is drained: every live router (heartbeat at most ``liveness_s`` old at
    ``now``) serves ``version`` or newer, and no call sent with an older known version (not 0) is in
    flight. Returns (ready, why not) with the lagging routers named."""
    behind = sorted(
        (b for b in heartbeats if now - b.at <= liveness_s and b.table_version < version), key=lambda b: b.router_id
    )
    if behind:
        names = ", ".join(f"{b.router_id!r} (v{b.table_version})" for b in behind)
        return False, f"router{'s' if len(behind) > 1 else ''} {names} not yet serving routing table v{version}"
    old = sorted((c for c in in_flight if 0 < c.table_version < version and c.calls > 0), key=lambda c: c.table_version)
    if old:
        calls = ", ".join(f"{c.calls} of v{c.table_version}" for c in old)
        return False, f"Dispatch calls still in flight ({calls}), older than v{version}"
    return True, ""


# -- canary --------------------------------------------------------------------------------

CANARY_TOKENS = 16
CANARY_SEED = 0


@dataclass(frozen=True)
class Canary:
    """One expert alone at weight 1: the partial sums are that expert's output."""

    hidden: torch.Tensor  # [CANARY_TOKENS, H], the group's dtype
    expert_ids: torch.Tensor  # [CANARY_TOKENS, 1] int32, all the expert
    weights: torch.Tensor  # [CANARY_TOKENS, 1] float32, all 1.0


def canary(hidden_size: int, dtype: torch.dtype, expert: int) -> Canary:
    generator = torch.Generator().manual_seed(CANARY_SEED)
    hidden = torch.randn(CANARY_TOKENS, hidden_size, generator=generator).to(dtype)
    return Canary(
        hidden=hidden,
        expert_ids=torch.full((CANARY_TOKENS, 1), expert, dtype=torch.int32),
        weights=torch.ones(CANARY_TOKENS, 1),
    )


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0


_TOLERANCE = {
    torch.float32: Tolerance(0.0, 0.0),
    torch.bfloat16: Tolerance(1e-2, 1e-2),
    torch.float16: Tolerance(1e-2, 1e-2),
}


def canary_tolerance(a: torch.dtype, b: torch.dtype) -> Tolerance:
    """The looser of two groups' dtypes: float32 replicas must agree bit for bit; half
    precision ones may round differently on different devices and kernels."""
    for dtype in (a, b):
        if dtype not in _TOLERANCE:
            raise ValueError(f"no canary tolerance for {dtype}; expert groups compute in {list(_TOLERANCE)}")
    return max(_TOLERANCE[a], _TOLERANCE[b], key=lambda t: (t.atol, t.rtol))


def canary_difference(reference: torch.Tensor, candidate: torch.Tensor, tolerance: Tolerance) -> float | None:
    """None when ``candidate`` [T, H] matches ``reference`` [T, H] within ``tolerance``; else max |Δ|
    (inf for a shape mismatch, nan when either holds a NaN)."""
    if reference.shape != candidate.shape:
        return float("inf")
    a, b = reference.float(), candidate.float()
    same = torch.equal(a, b) if tolerance.exact else torch.allclose(a, b, atol=tolerance.atol, rtol=tolerance.rtol)
    return None if same else float((a - b).abs().max())
