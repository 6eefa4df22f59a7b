"""Expert groups of a KubeRay ``RayService`` as the orchestrator's launcher (``orchestrator.elastic``).

Every group is a Serve application of its own in the RayService's ``spec.serveConfigV2``,
``expertmesh-group-<name>`` (``group_app``: its ``directory`` ingress and its ``group-<name>`` deployment, its
port in ``args.ports``, its island's resource and placement-group bundle): the chart renders one per group of
``expertGroups.groups`` (holding its experts), and ``KubeRayGroups.start`` appends one for a new, empty group
(``args.empty: [name]``). KubeRay hands the config to Serve, whose replica starts the group, which registers its
address in the state store: ``start`` returns once it is there and answers. ``stop`` takes a group's application
out again, the chart's groups' as well (drained first by the ``GroupController``), and returns once the group's
gRPC port no longer answers.

Why an application per group: under a RayService Serve versions every deployment of an application by the
hash of the application's config (import path, runtime env, ``args``), so a changed ``args`` restarts all of its
groups. An application added or removed leaves the others' configs, and replicas, untouched. A release of the
chart from before this (one application ``expertmesh-groups`` holding every chart group) has its groups
refused by ``check_stop`` until ``helm upgrade``; so is the last group.

``helm upgrade`` renders serveConfigV2 from the values again: a chart group removed live comes back (its
application, holding the chart's experts for it) while the routing table no longer lists it, so it takes no
tokens; lower ``expertGroups.groups`` to make a removal last.

Every write is a JSON merge patch carrying the resourceVersion it was computed from (409 Conflict: read
again, recompute; KubeRay writes the object too). ``serve_config_change`` and ``refusal`` are pure.

Example: ``refusal(service, gpus=1, island="", node="")`` on a CPU chart -> ``"--gpus 1: the chart runs
its expert groups on CPU (mode: cpu); leave --gpus out"``.
"""

from __future__ import annotations

import copy
import json
import logging
import socket
import threading
import time
from collections.abc import Callable

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from expertmesh.contracts.errors import GroupChangeRefused, GroupSpecRefused, GroupUnavailable
from expertmesh.contracts.topology import ISLAND_RESOURCE_PREFIX, island_resource
from expertmesh.orchestrator.kube.api import MERGE_PATCH, KubeApiError, KubeConnection, api_errors
from expertmesh.store import StateStore

__all__ = [
    "KubeRayGroups",
    "added_app",
    "app_failure",
    "fixed_groups",
    "group_app",
    "groups_of",
    "refusal",
    "serve_config_change",
]

log = logging.getLogger(__name__)

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayservices"
BUILDER = "expertmesh.expert_group.deployment:build_app"
#: the application of one group (``group_app``)
APP_PREFIX = "expertmesh-group-"
#: the ``args`` every group's application shares (the chart's values), beside its own placement, port, GPUs
#: and island
COMMON_ARGS = ("model", "dtype", "state_url", "deployment", "host", "port_base", "num_cpus", "budget_bytes", "warm_up")
#: seconds a group added live may take until it serves (KubeRay, Serve placing it, its start)
START_TIMEOUT_S = 600.0
#: seconds a group removed may take until its port stops answering
STOP_TIMEOUT_S = 300.0


# -- the serve config, pure -------------------------------------------------------------------------


def _apps(config: dict) -> list[dict]:
    return [a for a in config.get("applications") or () if a.get("import_path") == BUILDER]


def groups_of(app: dict) -> list[str]:
    """The groups an expertmesh application of a serve config runs."""
    args = app.get("args") or {}
    placed = ((args.get("placement") or {}).get("groups") or {}).keys()
    return sorted({*map(str, placed), *args.get("empty", ())})


def _template(config: dict) -> dict:
    """The application a group added live takes its arguments from: a chart group's (one with a placement: its
    ``args`` are the chart's values), else any group's."""
    apps = _apps(config)
    chart = [a for a in apps if (a.get("args") or {}).get("placement")]
    if not apps:
        raise GroupChangeRefused("the RayService's serveConfigV2 has no expertmesh groups application to add beside")
    return (chart or apps)[0]


def _ports(config: dict) -> set[int]:
    """The ports the groups of ``config`` listen on, as ``build_app`` gives them: group i of an application's
    placement (in name order) on ``port_base + i``, unless ``ports`` names its own."""
    used: set[int] = set()
    for app in _apps(config):
        args = app.get("args") or {}
        placed = sorted(((args.get("placement") or {}).get("groups") or {}).keys())
        ports = {g: int(args.get("port_base", 50100)) + i for i, g in enumerate(placed)}
        used |= set((ports | {g: int(p) for g, p in (args.get("ports") or {}).items()}).values())
    return used


def _island_capacity(service: dict) -> dict[str, int]:
    """island -> the slots its worker group declares (``rayStartParams.resources``, as the chart renders it)."""
    out: dict[str, int] = {}
    for wg in ((service.get("spec") or {}).get("rayClusterConfig") or {}).get("workerGroupSpecs") or ():
        raw = str((wg.get("rayStartParams") or {}).get("resources", "") or "")
        text = raw.strip().strip('"').replace('\\"', '"')
        try:
            declared = json.loads(text) if text else {}
        except ValueError:
            continue
        for key, amount in declared.items():
            if key.startswith(ISLAND_RESOURCE_PREFIX):
                out[key.removeprefix(ISLAND_RESOURCE_PREFIX)] = int(amount)
    return out


def _island_gpus(service: dict, island: str) -> float:
    """The GPUs of island ``island``'s worker pod (its Ray container's ``nvidia.com/gpu`` limit)."""
    for wg in ((service.get("spec") or {}).get("rayClusterConfig") or {}).get("workerGroupSpecs") or ():
        if wg.get("groupName") == f"island-{island}":
            containers = ((wg.get("template") or {}).get("spec") or {}).get("containers") or [{}]
            return float(((containers[0].get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
    return 0.0


def _island_deployments(config: dict, island: str) -> list[dict]:
    resource = island_resource(island)
    return [
        d
        for app in _apps(config)
        for d in app.get("deployments") or ()
        if resource in ((d.get("ray_actor_options") or {}).get("resources") or {})
    ]


def _island_users(config: dict, island: str) -> list[str]:
    return sorted(d["name"].removeprefix("group-") for d in _island_deployments(config, island))


def serve_config(service: dict) -> dict:
    return yaml.safe_load((service.get("spec") or {}).get("serveConfigV2") or "") or {}


def _gpu_chart(config: dict) -> bool:
    """Any of the chart's groups computes on GPUs."""
    return any(float((a.get("args") or {}).get("num_gpus", 0) or 0) > 0 for a in _apps(config))


def lasting_refusal(service: dict, *, gpus: int, island: str, node: str, config: dict | None = None) -> str | None:
    """Why the RayService can never take a group of ``gpus`` GPUs on ``island`` as the chart stands (``node``:
    never, on Kubernetes a group lands on its island's worker pod; GPUs on a CPU chart; an island without a worker
    group); None when it can, given room. ``config``: its serve config, when not the service's own."""
    if node:
        return "--node: on Kubernetes a group lands on a worker pod of its island; name --island instead"
    config = serve_config(service) if config is None else config
    if gpus and not _gpu_chart(config):
        return f"--gpus {gpus}: the chart runs its expert groups on CPU (mode: cpu); leave --gpus out"
    if island:
        capacity = _island_capacity(service)
        if island not in capacity:
            return (
                f"--island {island}: the RayService has no worker group for it (its islands: "
                f"{', '.join(sorted(capacity)) or 'none'}); add it to expertGroups.islands and upgrade the chart"
            )
    return None


def refusal(service: dict, *, gpus: int, island: str, node: str, config: dict | None = None) -> str | None:
    """Why the RayService cannot take a group of ``gpus`` GPUs on ``island`` now: ``lasting_refusal``'s reasons,
    or its island's slots or GPUs all held; None when it can. One line a person can act on."""
    config = serve_config(service) if config is None else config
    lasting = lasting_refusal(service, gpus=gpus, island=island, node=node, config=config)
    if lasting is not None:
        return lasting
    try:
        main = _template(config)
    except GroupChangeRefused as err:
        return str(err)
    if island:
        capacity = _island_capacity(service)
        users = _island_users(config, island)
        if len(users) >= capacity[island]:
            return (
                f"--island {island}: its {capacity[island]} slot(s) hold groups {', '.join(users)}; "
                "remove one first (`expertmesh groups remove NAME`)"
            )
        need = gpus or float((main.get("args") or {}).get("num_gpus", 0) or 0)
        used = sum(
            float((d.get("ray_actor_options") or {}).get("num_gpus", 0)) for d in _island_deployments(config, island)
        )
        have = _island_gpus(service, island)
        if _gpu_chart(config) and used + need > have:
            return (
                f"--island {island}: its worker pod has {have:g} GPUs, {used:g} held by groups {', '.join(users)}, "
                f"and the group needs {need:g}; remove one first (`expertmesh groups remove NAME`)"
            )
    return None


def _raise_refusal(service: dict, *, gpus: int, island: str, node: str, config: dict | None = None) -> None:
    """GroupSpecRefused for what the chart can never take, GroupChangeRefused for what it cannot take now."""
    lasting = lasting_refusal(service, gpus=gpus, island=island, node=node, config=config)
    if lasting is not None:
        raise GroupSpecRefused(lasting)
    why = refusal(service, gpus=gpus, island=island, node=node, config=config)
    if why is not None:
        raise GroupChangeRefused(why)


def group_app(name: str, common: dict, *, port: int, gpus: float, island: str, experts: dict | None = None) -> dict:
    """The Serve application of group ``name``: the one shape of every group's application, the chart's
    (templates/rayservice.yaml renders the same; tests/helm checks it) and those added live. ``common``: the
    ``COMMON_ARGS``; ``experts``: its placement (``{layer: [experts]}``, the chart's groups) or None (an empty
    group, filled by live moves)."""
    num_cpus = common.get("num_cpus", 1.0)
    args = {k: common[k] for k in COMMON_ARGS if k in common} | {"ports": {name: port}, "num_gpus": gpus}
    if experts is None:
        args["empty"] = [name]
    else:  # only its own experts: every expert hosted is the chart's placement's check, across the applications
        args |= {"placement": {"groups": {name: experts}}, "placement_complete": False}
    options: dict = {"num_cpus": num_cpus}
    if gpus:
        options["num_gpus"] = gpus
    deployment: dict = {"name": f"group-{name}", "num_replicas": 1, "ray_actor_options": options}
    if island:
        resource = island_resource(island)
        options["resources"] = {resource: 1}
        args["resources"] = {name: {resource: 1}}
        bundle = {"CPU": num_cpus, resource: 1, **({"GPU": gpus} if gpus else {})}
        deployment |= {"placement_group_bundles": [bundle], "placement_group_strategy": "STRICT_PACK"}
    return {
        "name": f"{APP_PREFIX}{name}",
        "route_prefix": None,
        "import_path": BUILDER,
        "args": args,
        "deployments": [{"name": "directory", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}, deployment],
    }


def added_app(config: dict, name: str, *, gpus: int, island: str) -> dict:
    """The Serve application of the empty group ``name``, beside the others: its arguments and options those
    of the chart's groups, on the lowest port of the chart's range no group uses."""
    base = _template(config).get("args") or {}
    used = _ports(config)
    port = next(p for p in range(int(base.get("port_base", 50100)), 65536) if p not in used)
    num_gpus = gpus or base.get("num_gpus", 0) or 0
    return group_app(name, base, port=port, gpus=num_gpus, island=island)


def serve_config_change(config: dict, *, add: dict | None = None, remove: str | None = None) -> dict:
    """``config`` with application ``add`` appended, or group ``remove``'s own application taken out."""
    out = copy.deepcopy(config)
    apps = out.setdefault("applications", [])
    if add is not None:
        apps.append(add)
    if remove is not None:
        out["applications"] = [a for a in apps if a.get("name") != f"{APP_PREFIX}{remove}"]
    return out


def stop_refusal(config: dict, name: str) -> str | None:
    """Why group ``name`` cannot be stopped live (None: it can, or it does not run here): it shares its
    application with other groups (a release of the chart from before one application per group), or it is
    the RayService's last group."""
    apps = _apps(config)
    for app in apps:
        groups = groups_of(app)
        if name not in groups:
            continue
        if len(groups) > 1:
            return (
                f"group {name} is one of the {len(groups)} groups of Serve application {app.get('name')}, which a "
                "release of the chart from before one application per group renders: taking it out would restart "
                "all of them; `helm upgrade` to this chart's version first (it restarts the groups once)"
            )
        if len(apps) == 1:
            return f"group {name} is the RayService's last expert group; add another first (`expertmesh groups add`)"
    return None


def fixed_groups(config: dict) -> set[str]:
    """The chart's groups (those its values place, holding experts): ``helm upgrade`` owns them, so an ExpertGroup
    never mirrors one nor stands for one. The launcher stops them live all the same (``stop_refusal``)."""
    return {g for app in _apps(config) if (app.get("args") or {}).get("placement") for g in groups_of(app)}


def app_failure(service: dict, app: str) -> str | None:
    """Serve's message when KubeRay reports application ``app`` as failed (``status.activeServiceStatus`` or
    ``pendingServiceStatus``, ``applicationStatuses[app]``: DEPLOY_FAILED or UNHEALTHY); None otherwise."""
    status = service.get("status") or {}
    for which in ("activeServiceStatus", "pendingServiceStatus"):
        apps = (status.get(which) or {}).get("applicationStatuses") or {}
        state = apps.get(app) or {}
        if state.get("status") in ("DEPLOY_FAILED", "UNHEALTHY"):
            return f"Serve application {app} is {state['status']}: {state.get('message') or 'no message'}"
    return None


# -- the launcher ---------------------------------------------------------------------------------------


def _answers(address: str, timeout_s: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class KubeRayGroups:
    """The groups of RayService ``name`` in ``namespace`` as the launcher the orchestrator adds and removes
    groups through (``running``, ``check``, ``check_stop``, ``start``, ``stop``)."""

    def __init__(
        self,
        connection: KubeConnection,
        name: str,
        store: StateStore,
        namespace: str | None = None,
        *,
        start_timeout_s: float = START_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        poll_s: float = 1.0,
        attempts: int = 5,
    ):
        self.name = name
        self.namespace = namespace or connection.namespace
        self._custom = kubernetes.client.CustomObjectsApi(connection.client)
        self._store = store
        self._start_timeout_s, self._stop_timeout_s, self._poll_s = start_timeout_s, stop_timeout_s, poll_s
        self._attempts = attempts
        self._lock = threading.Lock()

    # -- the object

    def service(self) -> dict:
        with api_errors(f"get rayservices/{self.name}"):
            try:
                return self._custom.get_namespaced_custom_object(
                    RAY_GROUP, RAY_VERSION, self.namespace, RAY_PLURAL, self.name
                )
            except ApiException as err:
                if err.status == 404:
                    raise GroupChangeRefused(
                        f"no RayService {self.name} in namespace {self.namespace} (--ray-service)"
                    ) from None
                raise

    def _change(self, edit: Callable[[dict], dict]) -> None:
        """Write ``edit(serve config)`` as the serveConfigV2, guarded by the resourceVersion it was read at; on
        409 Conflict read again and recompute."""
        for _ in range(self._attempts):
            service = self.service()
            text = yaml.safe_dump(edit(serve_config(service)), sort_keys=False)
            body = {
                "metadata": {"resourceVersion": service["metadata"]["resourceVersion"]},
                "spec": {"serveConfigV2": text},
            }
            with api_errors(f"patch rayservices/{self.name}"):
                try:
                    self._custom.patch_namespaced_custom_object(
                        RAY_GROUP, RAY_VERSION, self.namespace, RAY_PLURAL, self.name, body, _content_type=MERGE_PATCH
                    )
                    return
                except ApiException as err:
                    if err.status != 409:
                        raise
            log.info("rayservices/%s changed since it was read (409 Conflict); re-reading it", self.name)
        raise KubeApiError(f"rayservices/{self.name} kept conflicting; gave up after {self._attempts} tries")

    # -- the launcher protocol

    def running(self) -> dict[str, tuple[str, int]]:
        """name -> (address, 0) of every group the RayService's serveConfigV2 runs (address as registered, or
        empty while it starts)."""
        endpoints = self._store.endpoints()
        config = serve_config(self.service())
        return {g: (endpoints.get(g, ""), 0) for app in _apps(config) for g in groups_of(app)}

    def check(self, gpus: int = 0, island: str = "", node: str = "") -> None:
        _raise_refusal(self.service(), gpus=gpus, island=island, node=node)

    def check_stop(self, name: str) -> None:
        why = stop_refusal(serve_config(self.service()), name)
        if why is not None:
            raise GroupChangeRefused(why)

    def fixed_groups(self) -> set[str]:
        return fixed_groups(serve_config(self.service()))

    def start(self, name: str, gpus: int = 0, island: str = "", node: str = "") -> tuple[str, int]:
        """Add group ``name``'s application; (address, 0) once the group registered and answers (its pid lives
        in a pod: unknown here). One that does not serve in time is taken out again and raises."""
        with self._lock:

            def add(config: dict) -> dict:
                if any(name in groups_of(app) for app in _apps(config)):
                    raise GroupChangeRefused(f"the RayService runs a group {name!r} already")
                _raise_refusal(service, gpus=gpus, island=island, node=node, config=config)
                return serve_config_change(config, add=added_app(config, name, gpus=gpus, island=island))

            service = self.service()
            self._change(add)
            try:
                address = self._wait(lambda: self._serving(name), f"serve {name}", self._start_timeout_s)
            except BaseException:
                try:  # back to the groups that ran, untouched
                    self._change(lambda config: serve_config_change(config, remove=name))
                except Exception as err:
                    log.warning("expert group %s: its application stays in RayService %s: %s", name, self.name, err)
                raise
        return address, 0

    def stop(self, name: str) -> int:
        """Take group ``name``'s application out; 0 once its port no longer answers."""
        with self._lock:
            config = serve_config(self.service())
            why = stop_refusal(config, name)
            if why is not None:
                raise GroupChangeRefused(why)
            if not any(a.get("name") == f"{APP_PREFIX}{name}" for a in _apps(config)):
                raise GroupUnavailable(f"no application of expert group {name!r} in RayService {self.name}")
            address = self._store.endpoints().get(name, "")
            self._change(lambda config: serve_config_change(config, remove=name))
            self._wait(lambda: not address or not _answers(address), f"stop {name}", self._stop_timeout_s)
        return 0

    def _serving(self, name: str) -> str | None:
        """The group's address once it registered and answers; raises when Serve failed its application (as
        KubeRay reports it in the RayService's status)."""
        address = self._store.endpoints().get(name)
        if address and _answers(address):
            return address
        why = app_failure(self.service(), f"{APP_PREFIX}{name}")
        if why is not None:
            raise GroupUnavailable(f"expert group {name} did not serve: {why}")
        return None

    def _wait(self, done: Callable[[], object], doing: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            result = done()
            if result:
                return result
            if time.monotonic() > deadline:
                raise GroupUnavailable(
                    f"expert group did not {doing} within {timeout_s:.0f} s of the RayService {self.name} change "
                    f"(kubectl describe rayservice {self.name}; the Ray dashboard's Serve page says why)"
                )
            time.sleep(self._poll_s)
