"""``expertmesh migrate`` and ``expertmesh migrations``: live expert moves through the
orchestrator's admin API (``expertmesh orchestrator`` or ``expertmesh up --orchestrator``).

Exit codes as everywhere: 0 done, 1 a migration that ended Failed / RolledBack
(with ``--wait``), 2 bad input or an unreachable orchestrator (one line).
"""

from __future__ import annotations

import sys
import time

import grpc

from expertmesh.contracts.errors import ExpertMeshError, GroupUnavailable, InvalidRequest
from expertmesh.orchestrator.admin_client import DEFAULT_ADMIN, call, connect, follow
from expertmesh.orchestrator.migration.state import Phase
from expertmesh.v1 import admin_pb2 as pb

_MODES = {"move": pb.MIGRATION_MODE_MOVE, "replicate": pb.MIGRATION_MODE_REPLICATE, "evict": pb.MIGRATION_MODE_EVICT}
_COLUMNS = ("ID", "LAYER", "EXPERT", "FROM", "TO", "MODE", "PHASE", "TABLE", "DURATION")


def add_commands(commands) -> None:
    m = commands.add_parser("migrate", help="move, replicate or evict one expert live (make before break)")
    m.add_argument("--layer", type=int, required=True, help="MoE layer index")
    m.add_argument("--expert", type=int, required=True, help="expert id within the layer")
    m.add_argument("--to", dest="to_group", help="group that gets the expert (not for --mode evict)")
    m.add_argument("--from", dest="from_group", help="group that gives it up (default: its only replica)")
    m.add_argument("--mode", choices=sorted(_MODES), default="move", help="default move")
    m.add_argument("--wait", action="store_true", help="follow the migration until it ends; exit 1 unless it succeeded")
    m.add_argument("--admin", default=DEFAULT_ADMIN, help=f"orchestrator admin address (default {DEFAULT_ADMIN})")
    m.set_defaults(run=run_migrate)

    ls = commands.add_parser("migrations", help="list live expert migrations (table)")
    ls.add_argument("--watch", action="store_true", help="keep printing changes until Ctrl-C")
    ls.add_argument("--admin", default=DEFAULT_ADMIN, help=f"orchestrator admin address (default {DEFAULT_ADMIN})")
    ls.set_defaults(run=run_migrations)


def row(m: pb.Migration, now: float | None = None) -> tuple[str, ...]:
    from expertmesh.orchestrator.admin import (  # the admin server: torch; not at parse time
        mode_from_proto,
        phase_from_proto,
    )

    end = m.completed_at or (now if now is not None else time.time())
    return (
        m.id,
        str(m.layer),
        str(m.expert),
        m.source,
        m.target or "-",
        mode_from_proto(m.mode).value,
        phase_from_proto(m.phase).value + (f" ({m.failure})" if m.failure else ""),
        f"v{m.routing_table_version}",
        f"{end - m.started_at:.1f}s",
    )


def render(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [_COLUMNS, *rows]) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [_COLUMNS, *rows])


def run_migrate(args) -> int:
    from expertmesh.orchestrator.admin import phase_from_proto  # the admin server: torch; not at parse time

    if args.mode != "evict" and not args.to_group:
        raise InvalidRequest(f"--mode {args.mode} needs --to GROUP")
    channel, stub = connect(args.admin)
    with channel:
        started = call(
            stub.Migrate,
            pb.MigrateRequest(
                layer=args.layer,
                expert=args.expert,
                target=args.to_group or "",
                source=args.from_group or "",
                mode=_MODES[args.mode],
            ),
        )
        print(f"migration {started.id} started: {args.mode} layer {args.layer} expert {args.expert}", flush=True)
        if not args.wait:
            return 0
        final = started
        try:
            for update in follow(stub, started.id):
                print(
                    f"  {phase_from_proto(update.phase).value} (routing table v{update.routing_table_version})",
                    flush=True,
                )
                final = update
        except grpc.RpcError as err:
            raise GroupUnavailable(f"lost the orchestrator while waiting: {err.code().name}: {err.details()}") from None
        print(render([row(final)]))
        phase = phase_from_proto(final.phase)
        if phase is not Phase.SUCCEEDED:
            print(f"expertmesh migrate: {phase.value}: {final.reason}", file=sys.stderr)
            return 1
        return 0


def run_migrations(args) -> int:
    channel, stub = connect(args.admin)
    with channel:
        if not args.watch:
            listed = call(stub.ListMigrations, pb.ListMigrationsRequest()).migrations
            print(render([row(m) for m in listed]) if listed else "no migrations", flush=True)
            return 0
        # The stream starts with every record as it is, then one line per change.
        print(render([]), flush=True)
        try:
            for update in follow(stub):
                print(render([row(update)]).splitlines()[1], flush=True)
        except grpc.RpcError as err:
            raise ExpertMeshError(f"lost the orchestrator: {err.code().name}: {err.details()}") from None
    return 0
