"""The ExpertGroup controller: expert groups added and removed by ``kubectl apply`` / ``kubectl delete``.

Level-triggered, one pass (``sync_once``) every ``poll_s`` in a thread of the orchestrator, over a listing of
the namespace's objects and ``GroupController.records()`` (``group_objects`` has the two kinds of object and
``plan``, what a pass does):

1. an object listed by the last pass and gone now was deleted: its group is removed (drained, then stopped);
2. a requested object whose name is no group yet has its group added, or is ``Refused`` (a Warning Event);
3. a group added another way (the CLI, the admin API) gets a mirror object; the chart's groups never do;
4. every object's status follows its group's record (a merge patch of the status subresource guarded by
   resourceVersion), with one Event per change of phase; an object whose group was removed another way is
   deleted after its ``Stopped`` Event.

``GroupController`` runs one change at a time and raises for a second one (``checked_add`` /
``checked_remove``): an add refused that way, or by the launcher for now (an island full), leaves its object
``Pending`` with the reason and is tried again every pass; one the launcher can never place (``GroupSpecRefused``:
GPUs on a CPU chart) is ``Refused``. A removal refused is kept and tried again.

No finalizers: deletion is seen as absence, as for ExpertQuarantines, which keeps the verbs the chart grants to
list, create, delete and patch status (a finalizer needs update on every object, and an orchestrator that is
not installed any more would leave objects nobody can delete). The price: an object deleted while no
orchestrator ran is not seen go; its group, still running, gets a mirror at the next start, and deleting that
removes it. Listing every pass rather than watching: the objects are few (one per group added live).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from expertmesh.contracts.errors import ExpertMeshError, GroupNotFound, GroupSpecRefused
from expertmesh.orchestrator.elastic.controller import GroupController, GroupRequest
from expertmesh.orchestrator.kube.api import EventType, KubeConnection, ListedObjectApi
from expertmesh.orchestrator.kube.group_objects import (
    KIND,
    PLURAL,
    WARNING_PHASES,
    Add,
    Delete,
    ExpertGroup,
    GroupObjectStatus,
    GroupSpec,
    Mirror,
    Refuse,
    Remove,
    manifest,
    pending,
    plan,
    refused,
    status_of,
)
from expertmesh.orchestrator.kube.polling import PollingController

__all__ = ["ExpertGroupApi", "ExpertGroupController", "start_group_objects_controller"]

log = logging.getLogger(__name__)


class ExpertGroupApi(ListedObjectApi[ExpertGroup, GroupObjectStatus]):
    """The ExpertGroup calls: list, get, create, delete, status patches, Events."""

    kind, plural, parse = KIND, PLURAL, ExpertGroup.from_dict


class ExpertGroupController(PollingController):
    kinds = "ExpertGroups"

    def __init__(
        self,
        api: ExpertGroupApi,
        groups: GroupController,
        fixed: Callable[[], Collection[str]],
        namespace: str,
        poll_s: float = 2.0,
    ):
        """``fixed``: the chart's groups (``KubeRayGroups.fixed_groups``), which no object stands for."""
        super().__init__(namespace, poll_s, "expertmesh-kube-groups")
        self.api = api
        self._groups = groups
        self._fixed = fixed
        #: name -> the object as the last pass listed it
        self._seen: dict[str, ExpertGroup] = {}
        #: name -> a deleted object whose group's removal was refused: tried again next pass
        self._to_remove: dict[str, ExpertGroup] = {}

    def sync_once(self) -> None:
        objects = {o.name: o for o in self.api.list(self.namespace)}
        gone = {n: o for n, o in (self._seen | self._to_remove).items() if n not in objects}
        retry: dict[str, ExpertGroup] = {}  # kept only once the pass ends: a pass cut short forgets no removal
        decided: dict[str, GroupObjectStatus] = {}  # statuses not from a record: Pending, Refused
        deleting: set[str] = set()
        for action in plan(objects.values(), self._groups.records(), gone.values(), self._fixed()):
            match action:
                case Remove(name):
                    if not self._remove(gone[name]):
                        retry[name] = gone[name]
                case Add(name, spec):
                    decided |= self._add(objects[name], spec)
                case Refuse(name, reason, message):
                    log.warning("%s/%s: refused: %s", self.namespace, name, message)
                    decided[name] = refused(objects[name], reason, message)
                case Mirror(name):
                    objects[name] = self.api.create(self.namespace, manifest(name, GroupSpec(), mirror=True))
                    log.info("expert group %s: mirrored as %s/%s", name, self.namespace, name)
                case Delete(name):
                    deleting.add(name)
        records = {r.name: r for r in self._groups.records()}
        for obj in list(objects.values()):
            written = self._report(obj, decided.get(obj.name) or status_of(obj, records.get(obj.name)))
            if written is not None and obj.name in deleting:
                log.info("%s/%s: its group was removed another way; deleted", self.namespace, obj.name)
                self.api.delete(written)
            if written is None or obj.name in deleting:
                del objects[obj.name]
            else:
                objects[obj.name] = written
        self._seen, self._to_remove = objects, retry

    def _add(self, obj: ExpertGroup, spec: GroupSpec) -> dict[str, GroupObjectStatus]:
        """Ask for group ``obj.name``; {} once asked (its record says the rest), else its Pending status, or
        Refused for a spec the platform can never place."""
        try:
            self._groups.add(GroupRequest(obj.name, spec.gpus, spec.island, spec.node))
        except GroupSpecRefused as err:  # never placeable as the chart stands: asking again would not help
            log.warning("%s/%s: refused: %s", self.namespace, obj.name, err)
            return {obj.name: refused(obj, type(err).__name__, str(err))}
        except (ExpertMeshError, ConnectionError) as err:  # one change at a time, an island full, the store: retried
            if obj.status.message != str(err):
                log.info("%s/%s: pending: %s", self.namespace, obj.name, err)
            return {obj.name: pending(obj, type(err).__name__, str(err))}
        log.info("%s/%s: adding expert group %s", self.namespace, obj.name, obj.name)
        return {}

    def _remove(self, obj: ExpertGroup) -> bool:
        """Remove the group of deleted object ``obj``; False: refused for now, to try again next pass."""
        try:
            self._groups.remove(obj.name)
        except GroupNotFound:
            return True  # stopped already
        except (ExpertMeshError, ConnectionError) as err:  # a change in flight: the next pass tries again
            log.info("%s/%s was deleted; its group's removal waits: %s", self.namespace, obj.name, err)
            return False
        log.info("%s/%s was deleted: removing expert group %s", self.namespace, obj.name, obj.name)
        return True

    def _report(self, obj: ExpertGroup, status: GroupObjectStatus) -> ExpertGroup | None:
        """Write ``status`` with an Event when the phase changes. None: the object is gone."""
        if status == obj.status:
            return obj
        written = self.api.write_status(obj, lambda _: status)
        if written is not None and status.phase != obj.status.phase:
            kind = EventType.WARNING if status.phase in WARNING_PHASES else EventType.NORMAL
            self.api.record_event(written, kind, status.phase, status.message or f"expert group {obj.name}")
        return written


def start_group_objects_controller(
    connection: KubeConnection,
    groups: GroupController,
    fixed: Callable[[], Collection[str]],
    namespace: str | None = None,
) -> ExpertGroupController:
    return ExpertGroupController(ExpertGroupApi(connection), groups, fixed, namespace or connection.namespace).start()
