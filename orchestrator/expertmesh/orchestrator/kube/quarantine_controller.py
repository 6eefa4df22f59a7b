"""The ExpertQuarantine controller: quarantines in Kubernetes, both ways.

Level-triggered, one pass (``sync_once``) every ``poll_s`` in a thread of the
orchestrator, over a listing of the namespace's objects and the health
monitor's replica records (``quarantine`` has the two kinds of object):

1. an object listed by the last pass and gone now was deleted: its replicas
   still quarantined are released (reload, verify, probation);
2. a requested object the controller never acted on (no ``status.state``) has
   its replicas quarantined (initiator ``kubernetes``), or is ``Refused`` with
   the reason (a Warning Event);
3. a replica quarantined by ``kubernetes`` that no object covers (its object was
   deleted while no orchestrator ran) is released;
4. a replica out of service that no object covers gets a mirror object;
5. every object's status follows its replicas (a merge patch of the status
   subresource guarded by resourceVersion), with one Event per change of state
   (Warning when quarantined); a mirror whose replica is back in service is
   deleted after its last Event.

No finalizers: deletion is seen as absence, so an object deleted while the
orchestrator was down is caught by step 3 (requested) or mirrored again (a
mirror: the replica stays quarantined until released some other way).
Listing every pass rather than watching keeps this to the verbs the chart's
RBAC grants: list, create, delete, patch status (the objects are few: one per
quarantined expert).
"""

from __future__ import annotations

import logging

from expertmesh.contracts.errors import QuarantineRefused
from expertmesh.orchestrator.health.monitor import HealthMonitor, ReplicaStatus
from expertmesh.orchestrator.health.state import HealthState, Initiator
from expertmesh.orchestrator.kube.api import EventType, KubeConnection, ListedObjectApi
from expertmesh.orchestrator.kube.polling import PollingController
from expertmesh.orchestrator.kube.quarantine import (
    KIND,
    PLURAL,
    ExpertQuarantine,
    QuarantineSpec,
    QuarantineStatus,
    State,
    covered,
    manifest,
    mirror_name,
    out_of_service,
    refused,
    status_of,
)

log = logging.getLogger(__name__)

#: states an Event about reads as a warning
_WARNING_STATES = (State.QUARANTINED, State.SUSPECT, State.REFUSED)


class QuarantineApi(ListedObjectApi[ExpertQuarantine, QuarantineStatus]):
    """The ExpertQuarantine calls: list, get, create, delete, status patches, Events."""

    kind, plural, parse = KIND, PLURAL, ExpertQuarantine.from_dict


def _describe(spec: QuarantineSpec) -> str:
    return f"layer {spec.layer} expert {spec.expert}" + (f" on {spec.group}" if spec.group else "")


class QuarantineController(PollingController):
    kinds = "ExpertQuarantines"

    def __init__(self, api: QuarantineApi, monitor: HealthMonitor, namespace: str, poll_s: float = 2.0):
        super().__init__(namespace, poll_s, "expertmesh-kube-quarantine")
        self.api = api
        self._monitor = monitor
        #: name -> the object as the last pass listed it
        self._seen: dict[str, ExpertQuarantine] = {}

    def sync_once(self) -> None:
        objects = {o.name: o for o in self.api.list(self.namespace)}
        for name, gone in list(self._seen.items()):
            if name not in objects and gone.spec is not None:
                self._release(gone.spec, f"{gone.name} was deleted")
        for obj in objects.values():
            if not obj.mirror and not obj.status.state:
                objects[obj.name] = self._quarantine(obj)
        replicas = self._monitor.listing()
        specs = [o.spec for o in objects.values() if o.spec is not None and o.status.state != State.REFUSED]
        for s in replicas:
            rid, record = s.record.replica, s.record
            if any(spec.covers(rid.layer, rid.expert, rid.group) for spec in specs):
                continue
            if record.state is HealthState.QUARANTINED and record.quarantined_by is Initiator.KUBERNETES:
                self._release(
                    QuarantineSpec(rid.layer, rid.expert, rid.group), "no ExpertQuarantine covers it any more"
                )
            elif out_of_service(s):
                mirror = self._mirror(s)
                objects[mirror.name] = mirror
        replicas = self._monitor.listing()
        for obj in list(objects.values()):
            if self._report(obj, replicas) is None:
                del objects[obj.name]
        self._seen = objects

    def _quarantine(self, obj: ExpertQuarantine) -> ExpertQuarantine:
        """Act on a requested object once: quarantine what it covers, or refuse."""
        if obj.spec is None:
            return self._refuse(obj, obj.spec_problem)
        spec = obj.spec
        try:
            self._monitor.quarantine(
                spec.layer,
                spec.expert,
                spec.group,
                spec.reason or f"ExpertQuarantine {obj.namespace}/{obj.name}",
                by=Initiator.KUBERNETES,
            )
        except QuarantineRefused as err:
            return self._refuse(obj, str(err))
        log.warning("%s/%s: quarantined %s", obj.namespace, obj.name, _describe(spec))
        return obj

    def _refuse(self, obj: ExpertQuarantine, reason: str) -> ExpertQuarantine:
        log.warning("%s/%s: refused: %s", obj.namespace, obj.name, reason)
        written = self.api.write_status(obj, lambda _: refused(reason, obj.generation))
        if written is None:
            return obj
        self.api.record_event(written, EventType.WARNING, State.REFUSED.value, reason)
        return written

    def _release(self, spec: QuarantineSpec, why: str) -> None:
        try:
            statuses = self._monitor.release(spec.layer, spec.expert, spec.group)
        except QuarantineRefused:
            return  # nothing of it is quarantined any more
        still = [s.record.replica.group for s in statuses if s.record.state is HealthState.QUARANTINED]
        log.warning(
            "released %s (%s)%s",
            _describe(spec),
            why,
            f"; still quarantined on {still}: its repair failed" if still else "",
        )

    def _mirror(self, replica: ReplicaStatus) -> ExpertQuarantine:
        rid = replica.record.replica
        spec = QuarantineSpec(rid.layer, rid.expert, rid.group)
        return self.api.create(
            self.namespace, manifest(spec, mirror_name(rid.layer, rid.expert, rid.group), mirror=True)
        )

    def _report(self, obj: ExpertQuarantine, replicas: list[ReplicaStatus]) -> ExpertQuarantine | None:
        """Write the object's status from its replicas, with an Event on a change of state; delete a mirror
        whose replica is back in service. None: the object is gone."""
        if obj.spec is None or obj.status.state == State.REFUSED:
            return obj
        status = status_of(obj.spec, replicas, obj.generation)
        written = obj
        if status != obj.status:
            written = self.api.write_status(obj, lambda _: status)
            if written is None:
                return None
            if status.state != obj.status.state:
                kind = EventType.WARNING if status.state in _WARNING_STATES else EventType.NORMAL
                self.api.record_event(
                    written, kind, status.state, f"{_describe(obj.spec)}: {status.reason or status.state}"
                )
        if obj.mirror and not any(out_of_service(s) for s in covered(obj.spec, replicas)):
            self.api.delete(written)
            return None
        return written


def start_quarantine_controller(
    connection: KubeConnection, monitor: HealthMonitor, namespace: str | None = None
) -> QuarantineController:
    return QuarantineController(QuarantineApi(connection), monitor, namespace or connection.namespace).start()
