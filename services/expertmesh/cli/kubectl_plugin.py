"""``kubectl-expertmesh``, the kubectl plugin (``kubectl expertmesh …`` once the package's
console script is on PATH).

``migrate`` creates an ExpertMigration through the Kubernetes API (kubeconfig), so
the move is an object like any other: RBAC, audit log and ``kubectl get
expertmigrations`` apply; ``--wait`` watches it until Succeeded or Failed.

``experts`` reads the routing table and the routers' load windows from the state
store (Redis), not from the orchestrator's admin API: the store is where both live
(the admin API serves migrations only), and the store answers even while the
orchestrator restarts. From outside the cluster, port-forward the release's Redis
first (``kubectl port-forward svc/<release>-expertmesh-redis 6379``) and pass
``--state-url rediss://localhost:6379/0`` (or set ``EXPERTMESH_STATE_URL``; the Redis user,
password file and CA come from ``EXPERTMESH_REDIS_*`` as everywhere: ``RedisAuthConfig``).

``groups list|add|remove`` are ``expertmesh groups`` through the orchestrator's admin API
(port-forward it: ``kubectl port-forward svc/<release>-expertmesh-orchestrator 50052``). An
orchestrator that cannot start groups (Kubernetes, until the chart's ExpertGroup knob) lists
them and refuses add and remove with FAILED_PRECONDITION.

Exit codes as ``expertmesh``: 0 done, 1 a migration that ended Failed (or did not
end within ``--timeout``) with ``--wait``, 2 bad input or an unreachable API (one line).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest
from expertmesh.orchestrator.kube.api import ExpertMigrationApi, WatchExpired, connect, create_migration_object
from expertmesh.orchestrator.kube.resource import ConditionType, ExpertMigration, MigrationSpec, Origin
from expertmesh.orchestrator.migration.state import MigrationMode

PROG = "kubectl expertmesh"
_ROW = ("NAME", "LAYER", "EXPERT", "FROM", "TO", "STATUS", "TABLE")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Live expert migrations and placement of expertmesh.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    kube = argparse.ArgumentParser(add_help=False)
    kube.add_argument("-n", "--namespace", help="default: the kubeconfig context's namespace")
    kube.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    kube.add_argument("--context", help="kubeconfig context (default: the current one)")

    m = commands.add_parser(
        "migrate", parents=[kube], help="create an ExpertMigration: move, replicate or evict one expert live"
    )
    m.add_argument("--layer", type=int, required=True, help="MoE layer index")
    m.add_argument("--expert", type=int, required=True, help="expert id within the layer")
    m.add_argument("--to", dest="to_group", help="group that gets the expert (not for --mode evict)")
    m.add_argument("--from", dest="from_group", help="group that gives it up (default: its only replica)")
    m.add_argument("--mode", choices=[mode.value for mode in MigrationMode], default=MigrationMode.MOVE.value)
    m.add_argument("--name", help="object name (default: generated, l<layer>-e<expert>-xxxxx)")
    m.add_argument("--wait", action="store_true", help="follow the object until it ends; exit 1 unless it succeeded")
    m.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")
    m.set_defaults(run=run_migrate)

    e = commands.add_parser("experts", help="layer x expert -> groups, load share, routing-table version")
    e.add_argument(
        "--state-url",
        default=os.environ.get("EXPERTMESH_STATE_URL"),
        help="redis://host:port/db (default $EXPERTMESH_STATE_URL)",
    )
    e.add_argument("--layer", type=int, help="only this MoE layer")
    e.add_argument("-o", "--output", choices=["table", "json"], default="table")
    e.set_defaults(run=run_experts)

    from expertmesh.cli import group as group_cli  # the same subcommands as `expertmesh groups`

    g = commands.add_parser("groups", help="expert groups: list them, add or remove one live (admin API)")
    group_cli.add_elastic_commands(g.add_subparsers(dest="group_command", required=True, metavar="COMMAND"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except ExpertMeshError as err:
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# -- migrate -------------------------------------------------------------------------------------


def run_migrate(args) -> int:
    mode = MigrationMode(args.mode)
    if mode is not MigrationMode.EVICT and not args.to_group:
        raise InvalidRequest(f"--mode {mode} needs --to GROUP")
    if mode is MigrationMode.EVICT and args.to_group:
        raise InvalidRequest("--mode evict takes no --to")
    connection = connect(args.kubeconfig, args.context)
    api = ExpertMigrationApi(connection)
    spec = MigrationSpec(args.layer, args.expert, mode, args.from_group, args.to_group)
    obj = create_migration_object(api, spec, origin=Origin.MANUAL, namespace=args.namespace, name=args.name)
    print(f"expertmigration.expertmesh.io/{obj.name} created", flush=True)
    if not args.wait:
        return 0
    final = follow(api, obj, args.timeout)
    print(render([final]))
    succeeded = final.status.condition(ConditionType.SUCCEEDED)
    if succeeded is not None and succeeded.status == "True":
        return 0
    failed = final.status.condition(ConditionType.FAILED)
    if failed is not None and failed.status == "True":
        print(f"{PROG} migrate: {final.name} failed ({failed.reason}): {failed.message}", file=sys.stderr)
    else:
        print(
            f"{PROG} migrate: {final.name} did not end within {args.timeout:g} s; it goes on "
            f"(kubectl get expertmigration {final.name})",
            file=sys.stderr,
        )
    return 1


def follow(api: ExpertMigrationApi, obj: ExpertMigration, timeout_s: float) -> ExpertMigration:
    """Watch one object, printing each phase it reports, until it is finished or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    version, shown = obj.resource_version, ""
    while not obj.status.finished:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            for event in api.watch(obj.namespace, version, max(1, min(int(remaining), 60)), name=obj.name):
                version = event.resource_version
                if event.type == "DELETED":
                    raise InvalidRequest(f"expertmigration {obj.name} was deleted while waiting (its move goes on)")
                if event.object is None:
                    continue
                obj = event.object
                if obj.status.phase and obj.status.phase != shown:
                    shown = obj.status.phase
                    print(f"  {shown} (routing table v{obj.status.routing_table_version})", flush=True)
                if obj.status.finished:
                    break
        except WatchExpired:  # fell behind the server's history: read it afresh and go on from there
            fresh = api.get(obj.namespace, obj.name)
            if fresh is None:
                raise InvalidRequest(f"expertmigration {obj.name} was deleted while waiting") from None
            obj, version = fresh, fresh.resource_version
    return obj


def render(objects: list[ExpertMigration]) -> str:
    rows = [
        (
            o.name,
            str(o.spec.layer) if o.spec else "?",
            str(o.spec.expert) if o.spec else "?",
            o.status.source or "-",
            o.status.target or "-",
            o.status.phase or "-",
            f"v{o.status.routing_table_version}",
        )
        for o in objects
    ]
    widths = [max(len(r[i]) for r in [_ROW, *rows]) for i in range(len(_ROW))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [_ROW, *rows])


# -- experts -------------------------------------------------------------------------------------


def run_experts(args) -> int:
    from expertmesh.orchestrator.kube.experts import expert_rows, render_json, render_table
    from expertmesh.store import open_store

    if not args.state_url:
        raise InvalidRequest(
            "experts reads the state store: port-forward the release's Redis "
            "(kubectl port-forward svc/<release>-expertmesh-redis 6379) and pass --state-url redis://127.0.0.1:6379/0"
        )
    store = open_store(args.state_url)
    try:
        table = store.routing_table()
        published = store.loads()
        out_of_service = {key: q.state for key, q in store.quarantined().items()}
    except ConnectionError as err:
        raise InvalidRequest(f"the state store at {args.state_url} is unreachable: {err}") from None
    finally:
        store.close()
    if table is None:
        raise InvalidRequest(f"no routing table in {args.state_url} yet; are the expert groups up?")
    load = {}
    if published:
        from expertmesh.contracts.load_report import summed_pulses  # numpy and torch: only when there is load

        total = summed_pulses(published, now=time.time())
        if total is not None:
            load = {layer: tuple(float(x) for x in total.load[row]) for row, layer in enumerate(total.moe_layers)}
    rows = expert_rows(table, load, args.layer, out_of_service)
    print((render_json if args.output == "json" else render_table)(table, rows, len(published)))
    return 0
