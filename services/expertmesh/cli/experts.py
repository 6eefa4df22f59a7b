"""``expertmesh experts``, ``expertmesh quarantine`` and ``expertmesh release``: expert
health through the orchestrator's admin API.

``experts`` prints one row per replica (layer x expert x group): its state, whether
the routing table lists it, the KL of its last check, its mean output norm now and
at baseline, when it was last checked, what it was probed with (``recorded`` hidden
states of real traffic, or ``seeded`` ones where routers record none), and why it
is in its state. Exit codes as
everywhere: 0 done, 1 a release that left a replica quarantined (its verification
failed), 2 bad input or an unreachable orchestrator (one line).
"""

from __future__ import annotations

import time

from expertmesh.orchestrator.admin_client import DEFAULT_ADMIN, call, connect
from expertmesh.orchestrator.health.state import HealthState
from expertmesh.v1 import admin_pb2 as pb

_COLUMNS = ("LAYER", "EXPERT", "GROUP", "STATE", "LISTED", "KL", "NORM", "BASELINE", "LAST CHECK", "PROBE", "REASON")
#: a release reloads weights from disk: allow more than a listing's 30 s
RELEASE_TIMEOUT_S = 900.0


def add_commands(commands) -> None:
    ls = commands.add_parser("experts", help="list every expert replica's health (state, KL, baseline, last check)")
    ls.add_argument("--layer", type=int, help="only this MoE layer")
    ls.add_argument("--admin", default=DEFAULT_ADMIN, help=f"orchestrator admin address (default {DEFAULT_ADMIN})")
    ls.set_defaults(run=run_experts)

    q = commands.add_parser("quarantine", help="take an expert replica out of service now (until `expertmesh release`)")
    _target_arguments(q, "the replica on this group (default: every replica of the expert)")
    q.add_argument("--reason", default="", help="recorded on the replica (default: quarantined by an operator)")
    q.set_defaults(run=run_quarantine)

    r = commands.add_parser(
        "release", help="repair a quarantined replica: reload, verify against the checkpoint, probation"
    )
    _target_arguments(r, "the replica on this group (default: every quarantined replica of the expert)")
    r.set_defaults(run=run_release)


def _target_arguments(parser, group_help: str) -> None:
    parser.add_argument("--layer", type=int, required=True, help="MoE layer index")
    parser.add_argument("--expert", type=int, required=True, help="expert id within the layer")
    parser.add_argument("--group", help=group_help)
    parser.add_argument("--admin", default=DEFAULT_ADMIN, help=f"orchestrator admin address (default {DEFAULT_ADMIN})")


def _ago(at: float, now: float) -> str:
    return f"{now - at:.0f}s ago" if at else "never"


def _figure(message: pb.ReplicaHealth, field: str) -> str:
    return f"{getattr(message, field):.4g}" if message.HasField(field) else "-"


def row(r: pb.ReplicaHealth, now: float) -> tuple[str, ...]:
    from expertmesh.orchestrator.health.api import state_from_proto  # beside the monitor: torch; not at parse time

    return (
        str(r.layer),
        str(r.expert),
        r.group,
        state_from_proto(r.state).value + (f" ({r.quarantined_by})" if r.quarantined_by else ""),
        "yes" if r.listed else "no",
        _figure(r, "kl"),
        _figure(r, "norm_mean"),
        _figure(r, "baseline_norm_mean") + (f" ({_ago(r.baseline_at, now)})" if r.baseline_at else ""),
        _ago(r.last_check, now),
        r.probe_source or "-",
        r.reason or "-",
    )


def render(replicas, now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [_COLUMNS, *(row(r, now) for r in replicas)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run_experts(args) -> int:
    channel, stub = connect(args.admin)
    with channel:
        request = pb.ListExpertsRequest(layer=args.layer) if args.layer is not None else pb.ListExpertsRequest()
        replicas = call(stub.ListExperts, request).replicas
    print(render(replicas) if replicas else "no experts: the routing table is empty", flush=True)
    return 0


def run_quarantine(args) -> int:
    channel, stub = connect(args.admin)
    with channel:
        request = pb.QuarantineRequest(layer=args.layer, expert=args.expert, group=args.group or "", reason=args.reason)
        replicas = call(stub.Quarantine, request).replicas
    print(render(replicas), flush=True)
    return 0


def run_release(args) -> int:
    from expertmesh.orchestrator.health.api import state_from_proto  # beside the monitor: torch; not at parse time

    channel, stub = connect(args.admin)
    with channel:
        request = pb.ReleaseRequest(layer=args.layer, expert=args.expert, group=args.group or "")
        replicas = call(stub.Release, request, timeout=RELEASE_TIMEOUT_S).replicas
    print(render(replicas), flush=True)
    return 1 if any(state_from_proto(r.state) is HealthState.QUARANTINED for r in replicas) else 0
