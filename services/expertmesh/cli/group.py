"""``expertmesh group serve``: one expert group as a plain process.

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
    group = commands.add_parser("group", help="expert groups outside Ray")
    sub = group.add_subparsers(dest="group_command", required=True, metavar="COMMAND")
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
    p.set_defaults(run=_main)


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
    if args.group not in placement.groups:
        raise InputError(
            f"the placement has no group {args.group!r}; its groups: {', '.join(sorted(placement.groups))}"
        )
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
        pairs=placement.groups[args.group],
        **{k: v for k, v in given.items() if v is not None},
    )


def _main(args: argparse.Namespace) -> int:
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
