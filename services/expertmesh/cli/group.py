"""``expertmesh group serve``: one expert group as a plain process; ``expertmesh groups
add|remove|list`` (``group`` and ``groups`` are one command): expert groups added and removed
live through the orchestrator's admin API (``orchestrator.elastic``).

The same group a Ray Serve replica runs (``runtime.RunningGroup``: every
Dispatch path, the admin RPCs behind their authorisation, TLS from
``EXPERTMESH_TLS_*``), started without Ray: a Kubernetes Deployment without
KubeRay, a machine without Ray (the GPU benchmark), or by hand. With
``--state-url`` it registers its address in the shared store as a RayService
replica does, again every few seconds. Either way it prints one line on stdout
once it serves, then runs until SIGTERM or Ctrl-C:

    expertmesh group g0 is serving 8 experts on 10.0.0.5:50100 (pid 4242)

Which experts: ``--placement FILE`` names the groups and their experts; without
it the model's experts are split contiguously into ``--groups N`` groups named
g0, g1, ... (as ``expertmesh up`` splits them). ``--group`` picks this one.
"""

from __future__ import annotations

import argparse
import signal
import threading

from expertmesh.config.settings import DataPlaneConfig, add_config_argument, add_setting_flag
from expertmesh.expert_group.runtime import GroupSpec, RunningGroup, serving_line
from expertmesh.models.resolve import data_plane_config


def add_command(commands) -> None:
    group = commands.add_parser(
        "group", aliases=["groups"], help="expert groups: serve one as a plain process; add, remove, list them live"
    )
    sub = group.add_subparsers(dest="group_command", required=True, metavar="COMMAND")
    add_elastic_commands(sub)
    p = sub.add_parser("serve", help="serve one expert group as a plain process (the gRPC server Ray Serve runs)")
    p.add_argument(
        "--group", required=True, help="the group to serve, as the placement names it (g0, g1, ... with --groups)"
    )
    # the data plane's settings, with their precedence: flags > EXPERTMESH_* > --config file > defaults
    add_config_argument(p)
    add_setting_flag(p, DataPlaneConfig, "model", default_note="the embedded tiny model")
    for name in ("revision", "placement", "groups", "dtype", "warm_up"):
        add_setting_flag(p, DataPlaneConfig, name)
    p.add_argument("--host", help="address to bind (default 127.0.0.1); 0.0.0.0 advertises this host's IP")
    p.add_argument("--port", type=int, help="port to bind (default: any free one, printed)")
    p.add_argument("--threads", type=int, help="torch intra-op threads of the group (default 1)")
    p.add_argument(
        "--gpu", action="store_true", help="compute on the first GPU this process sees (CUDA_VISIBLE_DEVICES)"
    )
    add_setting_flag(p, DataPlaneConfig, "state_url")  # a shared store: the group registers its address there
    add_setting_flag(p, DataPlaneConfig, "deployment")
    p.add_argument(
        "--budget-bytes", type=int, help="most bytes of expert weights the group may hold (default: unlimited)"
    )
    p.add_argument(
        "--empty",
        action="store_true",
        help="start holding no experts, whatever the placement says (a group added live: the orchestrator "
        "fills it by moves) (default: off)",
    )
    p.add_argument(
        "--quiet-start",
        action="store_true",
        help="import the code and read the checkpoint in a thread at the lowest CPU priority, so a group started "
        "beside busy ones takes only idle CPU until it serves; it then serves at normal priority (`expertmesh "
        "groups add` starts groups so) (default: off)",
    )
    p.set_defaults(run=_main)


def add_elastic_commands(sub) -> None:
    """``add``, ``remove`` and ``list`` under ``sub`` (here and in the kubectl plugin)."""
    import os

    default_admin = os.environ.get("EXPERTMESH_ADMIN_ADDRESS", "127.0.0.1:50052")  # as admin_client's

    def admin(p) -> None:
        p.add_argument("--admin", default=default_admin, help="orchestrator admin address")

    def wait(p, what: str) -> None:
        p.add_argument("--wait", action="store_true", help=f"follow the change until {what}; exit 1 unless it did")
        p.add_argument("--timeout", type=float, default=1800.0, help="--wait: seconds to follow it at most")

    a = sub.add_parser("add", help="start a new, empty expert group and fill it by live moves (make before break)")
    a.add_argument("--name", help="its name (default: the next free g<N>)")
    a.add_argument("--gpus", type=int, default=0, help="GPUs of the group (0: as the platform's groups run)")
    a.add_argument("--island", help="NVLink island to place it on (Ray cluster, Kubernetes)")
    a.add_argument("--node", help="node to place it on (Ray cluster, Kubernetes)")
    wait(a, "the group serves")
    admin(a)
    a.set_defaults(run=_run_add)
    r = sub.add_parser("remove", help="drain an expert group by live moves (make before break), then stop it")
    r.add_argument("name", help="the group, as `expertmesh groups list` names it")
    wait(r, "its process stopped")
    admin(r)
    r.set_defaults(run=_run_remove)
    ls = sub.add_parser("list", help="the expert groups and where each stands (table)")
    admin(ls)
    ls.set_defaults(run=_run_list)


_GROUP_COLUMNS = ("NAME", "PHASE", "EXPERTS", "ADDRESS", "PID", "MOVES", "REASON")


def _phase(status) -> str:
    from expertmesh.v1 import admin_pb2 as pb

    return pb.GroupPhase.Name(status.phase).removeprefix("GROUP_PHASE_").lower()


def _group_rows(groups) -> str:
    rows = [
        (
            g.name,
            _phase(g),
            str(g.experts),
            g.address or "-",
            str(g.pid or "-"),
            f"{g.moves_done}/{g.moves_planned}" if g.moves_planned else "-",
            g.reason,
        )
        for g in groups
    ]
    widths = [max(len(r[i]) for r in [_GROUP_COLUMNS, *rows]) for i in range(len(_GROUP_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [_GROUP_COLUMNS, *rows])


def _follow(stub, name: str, done: str, timeout_s: float) -> int:
    """Print each change of group ``name`` until it is ``done`` (exit 0) or failed (exit 1)."""
    import sys
    import time

    from expertmesh.contracts.errors import DeadlineExceeded
    from expertmesh.orchestrator.admin_client import call
    from expertmesh.v1 import admin_pb2 as pb

    deadline, last = time.monotonic() + timeout_s, None
    while True:
        status = call(stub.GetGroup, pb.GetGroupRequest(name=name))
        shown = (_phase(status), status.moves_done, status.moves_planned)
        if shown != last:
            moves = f" ({status.moves_done}/{status.moves_planned} moves)" if status.moves_planned else ""
            print(f"  {shown[0]}{moves}", flush=True)
            last = shown
        if shown[0] in (done, "failed"):
            break
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"group {name} is still {shown[0]} after {timeout_s:g} s (it goes on)")
        time.sleep(0.25)
    print(_group_rows([status]), flush=True)
    if status.first_listed_at and done == "serving":
        print(f"routers could send it tokens {status.first_listed_at - status.requested_at:.1f} s after the add")
    if shown[0] != done:
        print(f"expertmesh groups: {name} failed: {status.reason}", file=sys.stderr)
        return 1
    return 0


def _run_add(args: argparse.Namespace) -> int:
    from expertmesh.orchestrator.admin_client import call, connect
    from expertmesh.v1 import admin_pb2 as pb

    channel, stub = connect(args.admin)
    with channel:
        request = pb.AddGroupRequest(
            name=args.name or "", gpus=args.gpus, island=args.island or "", node=args.node or ""
        )
        started = call(stub.AddGroup, request)
        print(f"group {started.name} {_phase(started)}", flush=True)
        return _follow(stub, started.name, "serving", args.timeout) if args.wait else 0


def _run_remove(args: argparse.Namespace) -> int:
    from expertmesh.orchestrator.admin_client import call, connect
    from expertmesh.v1 import admin_pb2 as pb

    channel, stub = connect(args.admin)
    with channel:
        started = call(stub.RemoveGroup, pb.RemoveGroupRequest(name=args.name))
        print(f"group {started.name} {_phase(started)} ({started.moves_planned} moves planned)", flush=True)
        return _follow(stub, started.name, "stopped", args.timeout) if args.wait else 0


def _run_list(args: argparse.Namespace) -> int:
    from expertmesh.orchestrator.admin_client import call, connect
    from expertmesh.v1 import admin_pb2 as pb

    channel, stub = connect(args.admin)
    with channel:
        groups = call(stub.ListGroups, pb.ListGroupsRequest()).groups
    print(_group_rows(groups) if groups else "no expert groups", flush=True)
    return 0


def _imported_and(work, args: argparse.Namespace):
    """``work(args)`` after importing what serving a group needs (torch, transformers, the group's service)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import expertmesh.expert_group.service  # noqa: F401
    import expertmesh.models.hosted_experts  # noqa: F401

    return work(args)


def group_spec(args: argparse.Namespace) -> GroupSpec:
    """The group ``args`` describe, checked against the checkpoint; unset flags keep GroupSpec's defaults."""
    from expertmesh.contracts import group_map as placement_mod
    from expertmesh.contracts.errors import InputError
    from expertmesh.models.checkpoint import Checkpoint

    config = data_plane_config(args)  # a Hub id resolves to the same snapshot a router resolves it to
    checkpoint = Checkpoint(config.model)
    spec = checkpoint.spec
    if config.placement is not None:
        placement = placement_mod.load(config.placement, spec)
    else:
        placement = placement_mod.contiguous(spec, config.groups)
    placement_mod.validate(placement, spec)
    if getattr(args, "empty", False):
        pairs: tuple = ()
    elif args.group not in placement.groups:
        raise InputError(
            f"the placement has no group {args.group!r}; its groups: {', '.join(sorted(placement.groups))} "
            "(--empty: start it holding none)"
        )
    else:
        pairs = placement.groups[args.group]
    given = {
        "dtype": config.dtype,
        "host": args.host,
        "port": args.port,
        "num_cpus": args.threads,
        "num_gpus": 1 if args.gpu else None,
        "state_url": None if config.state_url.startswith("memory://") else config.state_url,
        "deployment": config.deployment,
        "budget_bytes": args.budget_bytes,
        "warm_up": config.warm_up,
    }
    return GroupSpec(
        name=args.group,
        model_path=str(checkpoint.path.resolve()),
        pairs=pairs,
        **{k: v for k, v in given.items() if v is not None},
    )


def _main(args: argparse.Namespace) -> int:
    if args.quiet_start:
        import numpy  # noqa: F401  (here, at normal priority: its BLAS starts worker threads as it loads)

        from expertmesh.infra.cpu_priority import at_lowest_priority

        # the imports and the checkpoint's reading (3-4 CPU s); the threads that serve start below, at normal priority
        spec = at_lowest_priority(lambda: _imported_and(group_spec, args), name="expertmesh-group-start")
    else:
        spec = group_spec(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    group = RunningGroup(spec)
    try:
        print(serving_line(spec.name, len(group.pairs), group.address), flush=True)
        stop.wait()
    finally:
        group.stop()
    return 0
