"""The data plane in one object: expert groups on Ray Serve, their endpoints and
routing table in the state store, and the router's model dispatching to them.

``DataPlane.start(config)`` checks everything it can before starting anything
(checkpoint, placement), so a bad input is refused at start-up, not at the
first token. ``close()`` undeploys the groups and stops Ray if it started it.

``DataPlane.attach(config)`` is the router alone (``expertmesh up
--router-only``, as in Kubernetes): the groups run elsewhere (a RayService)
and the routing table and endpoints come from the shared state store.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from expertmesh.config.settings import DataPlaneConfig
from expertmesh.contracts import group_map as placement_mod
from expertmesh.contracts.errors import GroupUnavailable, InputError
from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.load_window import LoadWindow
from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable
from expertmesh.infra import security, telemetry
from expertmesh.infra.console import progress
from expertmesh.infra.cpu_threads import router_threads_here
from expertmesh.infra.devices import router_device
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.store import StateStore, open_store

if TYPE_CHECKING:
    from expertmesh.expert_group.deployment import GroupsApp
    from expertmesh.router.dispatch.dispatcher import LayerDispatcher
    from expertmesh.router.dispatch.heartbeat import Heartbeat
    from expertmesh.router.dispatch.table_watcher import TableWatcher
    from expertmesh.router.reporting.hidden_sample import SamplePublisher
    from expertmesh.router.reporting.load_publisher import LoadPublisher
    from expertmesh.router.weight_check import WeightWatch


def _check_reachable(address: str) -> None:
    """Fail in seconds, not minutes, when a Ray address has nobody listening (ray.init retries for long)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():
        return  # "auto", ray:// client addresses: let Ray resolve them
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise GroupUnavailable(f"cannot reach the Ray cluster at {address}: {err}") from None


def _gpu_layout(config: DataPlaneConfig, spec):
    """Expert groups from a GPU placement of `expertmesh plan` and its topology."""
    from expertmesh.contracts.gpu_plan import parse_placement_json
    from expertmesh.orchestrator import topology_discovery
    from expertmesh.orchestrator.placement.to_groups import groups_from_placement

    if config.topology is None:
        raise InputError("a GPU placement needs the topology it was planned for (--topology)")
    topology = topology_discovery.load_topology_file(config.topology)
    gpu_ids = tuple(site.gpu.id for site in topology.sites())
    text = topology_discovery.read_text(config.gpu_placement, "GPU placement")
    gpu_placement = parse_placement_json(text, gpu_ids, len(spec.moe_layers), spec.num_experts)
    return groups_from_placement(gpu_placement, topology, spec.moe_layers, config.group_per)


def _router(
    checkpoint: Checkpoint,
    store: StateStore,
    config: DataPlaneConfig,
    device: torch.device,
    resolve_endpoints=None,
    in_process=None,
):
    """The router over ``store``'s tables: its model, the table watcher keeping its view (started, with the
    heartbeat) and the layer dispatcher its experts calls go to. ``in_process``: the groups this process runs
    (``InProcessGroups.lookup``), which the transport calls in place."""
    from expertmesh.router.assembly import assemble_router
    from expertmesh.router.dispatch.heartbeat import Heartbeat
    from expertmesh.router.dispatch.hedging import HedgePolicy
    from expertmesh.router.reporting.hidden_sample import HiddenSampler
    from expertmesh.router.reporting.load_publisher import router_id
    from expertmesh.router.transport import build as build_transport

    progress(f"building the router on {device} (no routed-expert weights)")
    spec = checkpoint.spec
    heartbeat = Heartbeat(store, router_id(), config.heartbeat_s)
    threads = router_threads_here(config.router_threads)  # the lanes share them out; the large products take them
    router = assemble_router(
        store,
        spec.moe_layers,
        build_transport(
            config.transport,
            in_process,
            side_by_side=config.groups if in_process is not None and config.in_process_side_by_side else 1,
            threads=threads,
        ),
        threads=threads,
        checkpoint=checkpoint,
        dtype=getattr(torch, config.dtype),
        device=device,
        identity=ModelIdentity.of(spec),
        fallback=config.quarantine_fallback,
        heartbeat=heartbeat,
        poll_s=config.table_poll_s,
        timeout_s=config.dispatch_timeout_s,
        sole_group_wait_s=config.sole_group_wait_s,
        hedge=HedgePolicy(config.hedge_calls, config.hedge_delay_min_s, config.hedge_delay_max_s),
        load_window=LoadWindow(
            spec.moe_layers,
            spec.num_experts,
            spec.top_k,
            window_s=config.load_window_s,
            max_context=spec.max_context or 4096,
        ),
        resolve_endpoints=resolve_endpoints,
        hidden_sampler=(
            HiddenSampler(spec.moe_layers, config.hidden_sample_tokens) if config.hidden_sample_tokens else None
        ),
    )
    watcher = router.watcher
    heartbeat.start(lambda: watcher.version)
    watcher.start()
    return router.dispatcher, heartbeat, watcher, router.model


@dataclass
class DataPlane:
    config: DataPlaneConfig
    checkpoint: Checkpoint
    placement: GroupPlacement
    store: StateStore
    model: nn.Module
    dispatcher: "LayerDispatcher"
    heartbeat: "Heartbeat"
    watcher: "TableWatcher"
    addresses: dict[str, str]
    _started_ray: bool
    _owns_groups: bool = True
    #: the groups' Ray Serve application as ``start`` deployed it (None: attached), which the orchestrator's
    #: launcher adds groups to and removes them from (``platform.ray_groups``); ``addresses`` follows it
    groups_app: "GroupsApp | None" = None
    _publisher: "LoadPublisher" = field(init=False)
    #: publishes the router's hidden-state sample (None: sampling off)
    _samples: "SamplePublisher | None" = field(init=False)
    #: the router's own weights, fingerprinted at load and checked every ``router_weight_check_s``
    weights: "WeightWatch" = field(init=False)

    def __post_init__(self) -> None:
        # The in-process store too: an orchestrator embedded in this process (`up --orchestrator`) reads it.
        from expertmesh.router.reporting.load_publisher import LoadPublisher
        from expertmesh.router.weight_check import WeightWatch

        self.weights = WeightWatch(self.model, self.config.router_weight_check_s).start()

        self._publisher = LoadPublisher(
            self.store,
            self.dispatcher.load_window,
            self.config.load_publish_s,
            budget_bytes_s=self.config.load_inflow_budget_bytes_s,
        ).start()
        self._samples = None
        sampler = self.dispatcher.hidden_sampler
        if sampler is not None:
            from expertmesh.router.reporting.hidden_sample import SamplePublisher
            from expertmesh.router.reporting.load_publisher import router_id

            self._samples = SamplePublisher(self.store, sampler, router_id(), self.config.load_publish_s).start()

    @classmethod
    def start(cls, config: DataPlaneConfig) -> "DataPlane":
        """Everything on this machine (or a Ray cluster it joins): the group map, Ray, the groups on Ray Serve,
        their endpoints and the first routing table in the store, then the router."""
        t0 = time.monotonic()
        device = router_device(config.router_device)  # a GPU that is not there fails before anything starts
        checkpoint = Checkpoint(config.model)
        placement, layout = _group_map(config, checkpoint.spec)
        store = open_store(config.state_url, config.deployment)
        started_ray = _start_ray(config)
        addresses, groups_app = _deploy_groups(config, checkpoint, placement, layout, store)
        _publish_first_table(store, placement, checkpoint.spec, layout)
        dispatcher, heartbeat, watcher, model = _router(checkpoint, store, config, device, _serve_directory(store))
        progress(
            f"data plane ready in {time.monotonic() - t0:.1f}s: " + ", ".join(f"{g}@{a}" for g, a in addresses.items())
        )
        return cls(
            config,
            checkpoint,
            placement,
            store,
            model,
            dispatcher,
            heartbeat,
            watcher,
            addresses,
            started_ray,
            groups_app=groups_app,
        )

    @classmethod
    def attach(
        cls, config: DataPlaneConfig, wait_s: float = 300.0, store: StateStore | None = None, in_process=None
    ) -> "DataPlane":
        """The router alone, over groups and a routing table that others publish in the shared store
        (``store``, which the plane then owns; default: ``config.state_url``'s). ``in_process``: the groups
        among them that run in this process (``InProcessGroups.lookup``), called in place."""
        device = router_device(config.router_device)
        checkpoint = Checkpoint(config.model)
        store = store if store is not None else open_store(config.state_url, config.deployment)
        deadline = time.monotonic() + wait_s
        table = store.routing_table()
        if table is None:
            progress(f"waiting up to {wait_s:.0f}s for a routing table in {config.state_url}")
        while table is None:
            if time.monotonic() >= deadline:
                raise GroupUnavailable(
                    f"no routing table in {config.state_url} after {wait_s:.0f}s; is the orchestrator running?"
                )
            time.sleep(1.0)
            table = store.routing_table()
        placement = table.placement()
        try:
            placement_mod.validate(placement, checkpoint.spec)
        except InputError as err:
            raise InputError(f"the published routing table does not fit {checkpoint.path}: {err}") from None
        dispatcher, heartbeat, watcher, model = _router(checkpoint, store, config, device, in_process=in_process)
        progress(f"router attached to routing table version {table.version} ({len(placement.groups)} groups)")
        return cls(
            config,
            checkpoint,
            placement,
            store,
            model,
            dispatcher,
            heartbeat,
            watcher,
            store.endpoints(),
            False,
            _owns_groups=False,
        )

    @property
    def store_is_shared(self) -> bool:
        """Whether other processes read and write this plane's store (Redis), as opposed to its own in-process one."""
        return not self.config.state_url.startswith("memory://")

    def close(self) -> None:
        self.weights.stop()
        self._publisher.stop()
        if self._samples is not None:
            self._samples.stop()
        self.watcher.stop()
        self.heartbeat.stop()
        self.dispatcher.close()
        if not self._owns_groups:  # attached: neither Ray nor the groups are ours (nor, maybe, installed)
            self.store.close()
            return
        import ray

        from expertmesh.expert_group import deployment

        for group in self.addresses:
            self.store.remove_endpoint(group)
        self.store.close()
        if self._started_ray:
            # Ray's shutdown ends Serve's actors with it; shutting Serve down first only
            # makes the driver's long-poll clients print retry warnings.
            ray.shutdown()
        else:
            deployment.undeploy()

    def __enter__(self) -> "DataPlane":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the steps of DataPlane.start ---------------------------------------------------------------------------


def _group_map(config: DataPlaneConfig, spec) -> tuple[GroupPlacement, object | None]:
    """Which group hosts which experts: from the GPU plan (with its hardware layout), a group map file, or
    ``config.groups`` contiguous groups; validated against the model."""
    layout = _gpu_layout(config, spec) if config.gpu_placement is not None else None
    if layout is not None:
        placement = layout.placement
    elif config.placement is not None:
        placement = placement_mod.load(config.placement, spec)
    else:
        placement = placement_mod.contiguous(spec, config.groups)
    placement_mod.validate(placement, spec)
    return placement, layout


def _start_ray(config: DataPlaneConfig) -> bool:
    """Ray for the groups, unless this process runs in one already. True: a local Ray this plane started
    (and stops on close)."""
    import ray

    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    if ray.is_initialized():
        return False
    progress(f"starting Ray ({config.ray_address or 'local'})")
    if config.ray_address:
        _check_reachable(config.ray_address)
    try:
        # "local": a Ray of our own, never a cluster some earlier `ray start` left registered on the machine.
        ray.init(
            address=config.ray_address or "local",
            include_dashboard=False,
            log_to_driver=False,
            logging_level="WARNING",
        )
    except ConnectionError as err:
        raise GroupUnavailable(f"cannot join the Ray cluster at {config.ray_address}: {err}") from None
    return config.ray_address is None


def group_spec(config: DataPlaneConfig, checkpoint: Checkpoint, name: str, pairs, table_after: int, **hardware):
    """The ``GroupSpec`` of group ``name`` holding ``pairs`` on Ray Serve, as this platform runs its groups;
    ``hardware``: its GPUs, custom resources, NUMA node and budget where the GPU plan (or the add) says."""
    from expertmesh.expert_group import deployment

    fields = dict(
        name=name,
        model_path=str(checkpoint.path.resolve()),
        pairs=tuple(pairs),
        dtype=config.dtype,
        host=config.group_host,
        num_cpus=config.group_num_cpus,
        inherited_env={**telemetry.propagation_env(), **security.propagation_env()},
        budget_bytes=config.group_budget_bytes,
        # a shared store: the groups register themselves too, so a flushed store lists them again
        state_url=None if config.state_url.startswith("memory://") else config.state_url,
        deployment=config.deployment,
        table_after=table_after,
        warm_up=config.warm_up,
    )
    return deployment.GroupSpec(**(fields | hardware))


def _deploy_groups(
    config: DataPlaneConfig, checkpoint: Checkpoint, placement: GroupPlacement, layout, store: StateStore
) -> tuple[dict[str, str], "GroupsApp"]:
    """One Ray Serve deployment per group of ``placement``, loaded; their addresses, also in the store, and
    the application they run in (which adds and removes groups later: ``platform.ray_groups``)."""
    from expertmesh.expert_group import deployment

    spec = checkpoint.spec
    has_gpus = deployment.cluster_has_gpus()
    gpus = 1 if has_gpus else 0
    # the table published after these start is the first one they follow when Serve restarts them
    table_after = store.routing_table_version()
    specs = []
    for name, pairs in placement.groups.items():
        # a GPU plan's group: its GPUs, island and NUMA node; any other: one GPU where the cluster has them
        hardware = {"num_gpus": gpus} | (deployment.hardware_binding(layout.hardware[name], has_gpus) if layout else {})
        # unset: a group placed on GPUs holds what their memory does, less the memory model's overhead
        if layout and not config.group_budget_bytes:
            hardware["budget_bytes"] = layout.hardware[name].expert_budget_bytes
        specs.append(group_spec(config, checkpoint, name, pairs, table_after, **hardware))
    progress(
        f"starting {len(specs)} expert groups on Ray Serve for {spec.model_type} "
        f"({len(spec.moe_layers)} MoE layers x {spec.num_experts} experts, {'GPU' if gpus else 'CPU'})"
    )
    app = deployment.GroupsApp()
    with deployment.groups_loading(len(specs)):  # a bar on a terminal
        addresses = app.deploy(specs)
    for group, address in addresses.items():
        store.set_endpoint(group, address)
    return addresses, app


def _publish_first_table(store: StateStore, placement: GroupPlacement, spec, layout) -> None:
    """The routing table of ``placement`` (the GPU plan's shares, if any), one version above the store's."""
    table = RoutingTable.from_placement(
        placement,
        spec.num_experts,
        version=store.routing_table_version() + 1,
        shares=layout.shares if layout else None,
        model=ModelIdentity.of(spec),
    )
    if not store.publish_routing_table(table):
        raise RuntimeError("another writer changed the routing table while the groups started; retry")


def _serve_directory(store: StateStore):
    """Fresh group -> address map for the router when a group stops answering: a restarted replica listens
    on a new port, so ask Serve's directory and record the answer in the store."""

    def resolve_endpoints() -> dict[str, str]:
        from expertmesh.expert_group import deployment

        fresh = deployment.current_addresses()
        for group, address in fresh.items():
            store.set_endpoint(group, address)
        return fresh

    return resolve_endpoints
