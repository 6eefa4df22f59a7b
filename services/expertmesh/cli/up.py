"""``expertmesh up``: the whole platform in one command.

With no arguments it serves the embedded tiny model: local Ray, 2 expert
groups, the in-process state store, and the Inference API on 127.0.0.1:50051
(with ``--http-port``, the OpenAI-compatible HTTP API beside it).
It runs until Ctrl-C or SIGTERM, then drains in-flight requests and shuts every
process down. Settings: ``expertmesh.config.settings`` (flags > ``EXPERTMESH_*`` > ``--config`` file > defaults).
"""

from __future__ import annotations

import argparse

from expertmesh.config.settings import (
    DataPlaneConfig,
    add_data_plane_arguments,
    add_serving_arguments,
    add_setting_flag,
)
from expertmesh.contracts.errors import InputError


def add_command(commands) -> None:
    parser = commands.add_parser("up", help="run the platform: expert groups, router and the Inference gRPC API")
    add_data_plane_arguments(parser)
    add_setting_flag(parser, DataPlaneConfig, "router_threads")
    for name in (
        "hedge_calls",
        "hedge_delay_min_s",
        "hedge_delay_max_s",
        "warm_up",
        "router_weight_check_s",
        "group_wait_for_room_s",
    ):
        add_setting_flag(parser, DataPlaneConfig, name)
    add_serving_arguments(parser)
    parser.add_argument(
        "--router-only",
        action="store_true",
        help="serve only the router: groups and routing table come from --state-url (as in Kubernetes) (default: off)",
    )
    parser.add_argument(
        "--wait-for-table",
        type=float,
        default=300.0,
        help="--router-only: seconds to wait for a routing table (default: %(default)s)",
    )
    parser.add_argument(
        "--groups-as",
        choices=("ray", "process", "in-process"),
        default="ray",
        help="expert groups as Ray Serve deployments, as plain `expertmesh group serve` processes on this host "
        "(no Ray), or in this process, called in place (no Ray, no group processes, less memory; on a host of few "
        "cores a lone stream's tokens come faster, a loaded one's as fast); "
        "either way, with --orchestrator groups can be added and removed live (`expertmesh groups add`, "
        "`groups remove`) (default: %(default)s)",
    )
    parser.add_argument(
        "--orchestrator",
        action="store_true",
        help="also run the orchestrator's admin API in this process (live migrations: `expertmesh migrate`; "
        "expert groups added and removed live: `expertmesh groups add|remove|list`, on Ray Serve or as processes) "
        "(default: off)",
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        default=50052,
        help="--orchestrator: admin gRPC port, 0 picks one (default: %(default)s)",
    )
    try:
        from expertmesh.orchestrator.capacity.config import add_capacity_argument
        from expertmesh.orchestrator.drift.config import add_drift_argument
        from expertmesh.orchestrator.health.config import add_health_argument
    except ImportError:  # a data-plane-only install has no orchestrator
        pass
    else:
        add_drift_argument(parser)
        add_health_argument(parser)
        add_capacity_argument(parser)
    parser.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    import signal
    import threading

    from expertmesh.config.settings import ServingConfig, settings_from_args
    from expertmesh.models.resolve import data_plane_config

    serving_config = settings_from_args(ServingConfig, args)  # settings first: a bad one fails before anything starts
    if serving_config.profiles is not None:
        from expertmesh.router.policy.profiles import read_profiles_file

        read_profiles_file(serving_config.profiles)  # likewise a bad profiles file (its fit to the model: at start)
    data_config = data_plane_config(args)
    if args.orchestrator:
        from expertmesh.orchestrator.capacity.config import capacity_config
        from expertmesh.orchestrator.drift.config import drift_config
        from expertmesh.orchestrator.health.config import health_config

        drift = drift_config(args)  # a bad EXPERTMESH_DRIFT_* setting fails here, before anything starts
        health_settings = health_config(args)  # likewise EXPERTMESH_HEALTH_*
        capacity = capacity_config(args)  # and EXPERTMESH_CAPACITY_*
    elif getattr(args, "drift", None):
        raise InputError("--drift runs in the orchestrator: add --orchestrator")
    elif getattr(args, "capacity", None):
        raise InputError("--capacity runs in the orchestrator: add --orchestrator")
    elif getattr(args, "health_monitor", None):
        raise InputError("--health-monitor runs in the orchestrator: add --orchestrator")

    from expertmesh.infra.console import progress
    from expertmesh.infra.telemetry import setup as setup_telemetry
    from expertmesh.platform.data_plane import DataPlane
    from expertmesh.platform.router_apis import start_apis

    telemetry = setup_telemetry(
        "expertmesh-router",
        prometheus_port=serving_config.metrics_port,
        prometheus=serving_config.http_port is not None,
    )
    if telemetry.prometheus_port is not None:
        progress(f"Prometheus metrics on :{telemetry.prometheus_port}/metrics")
    local_groups = None
    if args.router_only:
        if data_config.state_url.startswith("memory://"):
            raise InputError("--router-only needs a shared --state-url (redis://host:port/db) with a routing table")
        if args.groups_as != "ray":
            raise InputError("--router-only starts no groups: leave --groups-as out")
        plane = DataPlane.attach(data_config, wait_s=args.wait_for_table)
    elif args.groups_as in ("process", "in-process"):
        plane, local_groups = _local_plane(data_config, args.groups_as)
    else:
        plane = DataPlane.start(data_config)
    _set_router_threads(data_config)
    # After Ray's start: its core worker installs a SIGTERM handler of its own that would exit without draining.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    orchestrator = None
    try:
        if args.orchestrator:
            from expertmesh.orchestrator.admin import start_orchestrator
            from expertmesh.orchestrator.health.monitor import HealthMonitor

            monitor = HealthMonitor(plane.store, plane.checkpoint, health_settings)
            orchestrator = start_orchestrator(
                plane.store,
                serving_config.host,
                args.admin_port,
                drift=drift,
                health=monitor,
                capacity=capacity,
                managers=_table_keeper(plane, monitor),
                model_fingerprint=plane.checkpoint.spec.fingerprint,
                launcher=_launcher(plane, local_groups),
            )
            progress(f"orchestrator admin gRPC on {serving_config.host}:{orchestrator.server.port}")
        apis = start_apis(plane, serving_config)
        if apis.http is not None:
            progress(f"OpenAI-compatible HTTP API on {apis.http.url}/v1 (also /health, /metrics)")
        target = f"{serving_config.host}:{apis.grpc.port}"
        print(
            f"expertmesh is serving {plane.config.model_name or plane.checkpoint.path.name} on {target} — try: "
            f"expertmesh generate 'Hello' --target {target}   (Ctrl-C to stop)",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        progress("draining in-flight requests")
        drained = apis.drain_and_stop()
        progress("drained" if drained else "drain timeout: remaining requests were cut off")
    finally:
        if orchestrator is not None:
            orchestrator.stop()
        if local_groups is None:
            progress("stopping expert groups and Ray")
            plane.close()
        else:
            progress("stopping the expert groups")
            plane.close()
            local_groups.stop_all()
        telemetry.shutdown()
    return 0


def _launcher(plane, local_groups):
    """What the orchestrator adds and removes groups through, as the platform runs them: the groups on this
    host (processes, or in this process), or deployments of the plane's Ray Serve groups application; None for
    a router alone (Kubernetes: the RayService's groups are not this process's to change)."""
    if local_groups is not None:
        return local_groups
    if plane.groups_app is None:
        return None
    from expertmesh.platform.ray_groups import RayGroups

    return RayGroups(plane)


def _local_plane(config, groups_as: str):
    """The router over ``config.groups`` groups on this host, no Ray: plain group processes
    (``platform.group_processes``) or groups in this process (``platform.in_process_groups``). Returns the
    plane and the groups (the orchestrator's launcher). The store is the config's (in-process by default)."""
    from expertmesh.infra.console import progress
    from expertmesh.platform.data_plane import DataPlane
    from expertmesh.platform.group_processes import start_process_groups
    from expertmesh.platform.in_process_groups import start_in_process_groups
    from expertmesh.store import open_store

    store = open_store(config.state_url, config.deployment)
    in_process = groups_as == "in-process"
    progress(
        "starting the expert groups in this process"
        if in_process
        else "starting the expert groups as processes (expertmesh group serve)"
    )
    try:
        groups = start_in_process_groups(config, store) if in_process else start_process_groups(config, store)
    except BaseException:
        store.close()
        raise
    try:
        plane = DataPlane.attach(config, store=store, in_process=groups.lookup if in_process else None)
    except BaseException:
        groups.stop_all()
        raise
    progress("data plane ready: " + ", ".join(f"{g}@{a}" for g, (a, _) in sorted(groups.running().items())))
    return plane, groups


def _set_router_threads(config) -> None:
    """The router's torch intra-op threads (``router_threads``; auto: every CPU of the host, see ``cpu_threads``)."""
    import torch

    from expertmesh.infra.console import progress
    from expertmesh.infra.cpu_threads import router_threads_here

    threads = router_threads_here(config.router_threads)
    torch.set_num_threads(threads)
    how = "set" if config.router_threads else f"auto: the host's {threads} CPUs"  # auto: as many as the CPUs
    progress(f"router: {threads} torch intra-op threads ({how})")


def _table_keeper(plane, health=None) -> list:
    """With a shared store, the embedded orchestrator keeps the routing table there: a flushed store gets it
    back, rebuilt from what the groups hold (they register again themselves), at a version above the router's,
    after ``health`` (the health monitor) restored its quarantines. An in-process store cannot be flushed from
    outside: nothing to keep."""
    if not plane.store_is_shared:
        return []
    from expertmesh.orchestrator.control_loop import Manager
    from expertmesh.orchestrator.reconcile import Reconciler, what_runs

    observe, _ = what_runs(plane.store, plane.checkpoint.spec.fingerprint)
    reconciler = Reconciler(plane.store, plane.checkpoint.spec, plane.placement, observe=observe, health=health)
    # Its first round now, over the table the plane has just published: that records the placement as applied,
    # and later rounds leave a table in use alone. Left to the loop (5 s on), that round found whatever a first
    # live move had published by then, and overwrote it with the start's placement.
    reconciler.reconcile_once()
    return [Manager("routing-table", 5.0, reconciler.reconcile_once)]
