"""The Kubernetes API calls of the control plane, through the ``kubernetes`` client.

``connect`` uses the pod's service account inside a cluster (an orchestrator pod
has no kubectl) and a kubeconfig elsewhere (the kubectl plugin, a laptop).
``ExpertMigrationApi`` reads and writes ``ExpertMigration`` objects as typed
values; ``create_migration_object`` is what the drift controller and ``kubectl
expertmesh migrate`` call to ask for a move.

Two API-server behaviours are part of the contract here:

- Status writes are JSON merge patches of the ``status`` subresource carrying the
  ``resourceVersion`` they were computed from, so a concurrent writer makes the
  server answer 409 Conflict instead of one write silently undoing another;
  ``write_status`` then re-reads the object and recomputes (a few times).
- A watch resumed from a resourceVersion the server no longer keeps answers an
  ERROR event with code 410 Gone; ``watch`` raises ``WatchExpired`` and the caller
  lists again.

Custom resources take merge patches only (the client's default, a strategic merge
patch, is refused with 415), hence the explicit content type.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Generic, TypeVar

import grpc
import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.watch.watch import iter_resp_lines

from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.orchestrator.kube.resource import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    ExpertMigration,
    MigrationSpec,
    MigrationStatus,
    Origin,
    manifest,
    rfc3339,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
S = TypeVar("S")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MERGE_PATCH = "application/merge-patch+json"
#: ``source.component`` / ``reportingComponent`` of the Events the orchestrator records
COMPONENT = "expertmesh-orchestrator"
_HTTP_GONE = 410


class KubeApiError(ExpertMeshError):
    """The Kubernetes API cannot be reached, refuses the credentials, or refused a call (the
    message carries the server's status and reason, e.g. ``422 Unprocessable Entity: ...``)."""

    code = grpc.StatusCode.UNAVAILABLE


class WatchExpired(Exception):
    """410 Gone: the watch's resourceVersion is older than the server keeps; list again."""


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True)
class KubeConnection:
    client: kubernetes.client.ApiClient
    #: the pod's namespace in a cluster, else the kubeconfig context's ("default" when it names none)
    namespace: str


def in_cluster() -> bool:
    """Running in a pod: Kubernetes sets this variable in every container."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def connect(kubeconfig: str | None = None, context: str | None = None) -> KubeConnection:
    """The service account in a pod unless a kubeconfig or context is named; else the kubeconfig
    (``$KUBECONFIG`` or ``~/.kube/config``)."""
    configuration = kubernetes.client.Configuration()
    try:
        if kubeconfig is None and context is None and in_cluster():
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        else:
            kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")  # read now: the client reads it once, at import
            kubernetes.config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
            contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
            chosen = next((c for c in contexts if c["name"] == context), active) if context else active
            namespace = (chosen.get("context") or {}).get("namespace") or "default"
    except (ConfigException, OSError) as err:
        raise KubeApiError(f"no Kubernetes credentials: {err}") from None
    return KubeConnection(kubernetes.client.ApiClient(configuration), namespace)


def _problem(err: ApiException) -> str:
    """One line from an API error: the Status object's message when the server sent one."""
    try:
        message = json.loads(err.body)["message"]
    except (TypeError, ValueError, KeyError):
        message = err.reason
    return f"{err.status} {err.reason}: {message}"


@contextmanager
def api_errors(what: str):
    """API errors other than those the caller handles, and unreachable servers, as KubeApiError."""
    try:
        yield
    except ApiException as err:
        raise KubeApiError(f"{what}: {_problem(err)}") from None
    except urllib3.exceptions.HTTPError as err:
        raise KubeApiError(f"{what}: the Kubernetes API is unreachable ({err})") from None


@dataclass(frozen=True)
class Listing:
    items: tuple[ExpertMigration, ...]
    #: where a watch continues from
    resource_version: str


@dataclass(frozen=True)
class WatchEvent:
    #: ADDED, MODIFIED, DELETED or BOOKMARK
    type: str
    resource_version: str
    #: None for a BOOKMARK
    object: ExpertMigration | None


class CustomObjectApi(Generic[T, S]):
    """The calls every custom resource of this package needs: get, create, status writes guarded by
    resourceVersion, Events. ``parse`` reads an object (with ``name``, ``namespace``, ``uid``,
    ``resource_version`` and ``status``, whose type has ``to_dict``)."""

    kind: str
    plural: str
    parse: Callable[[dict], T]

    def __init__(self, connection: KubeConnection):
        self.namespace = connection.namespace
        self._custom = kubernetes.client.CustomObjectsApi(connection.client)
        self._core = kubernetes.client.CoreV1Api(connection.client)

    def get(self, namespace: str, name: str) -> T | None:
        """The object, or None when it does not exist (any more)."""
        with api_errors(f"get {self.plural}/{name}"):
            try:
                return type(self).parse(
                    self._custom.get_namespaced_custom_object(GROUP, VERSION, namespace, self.plural, name)
                )
            except ApiException as err:
                if err.status == 404:
                    return None
                raise

    def create(self, namespace: str, body: dict) -> T:
        with api_errors(f"create {self.kind}"):
            return type(self).parse(
                self._custom.create_namespaced_custom_object(GROUP, VERSION, namespace, self.plural, body)
            )

    def write_status(self, obj: T, compute: Callable[[T], S], attempts: int = 5) -> T | None:
        """Write ``compute(obj)`` as the status, guarded by ``obj``'s resourceVersion; on 409 Conflict
        re-read and recompute. Returns the object as written (as it was, when nothing changed), or
        None when it was deleted."""
        current = obj
        for _ in range(attempts):
            status = compute(current)
            if status == current.status:
                return current
            body = {"metadata": {"resourceVersion": current.resource_version}, "status": status.to_dict()}
            with api_errors(f"update {self.plural}/{obj.name}/status"):
                try:
                    doc = self._custom.patch_namespaced_custom_object_status(
                        GROUP, VERSION, obj.namespace, self.plural, obj.name, body, _content_type=MERGE_PATCH
                    )
                    return type(self).parse(doc)
                except ApiException as err:
                    if err.status == 404:
                        return None
                    if err.status != 409:
                        raise
            log.info("%s/%s changed since it was read (409 Conflict); re-reading it", obj.namespace, obj.name)
            refreshed = self.get(obj.namespace, obj.name)
            if refreshed is None:
                return None
            current = refreshed
        raise KubeApiError(f"the status of {self.plural}/{obj.name} kept conflicting; gave up after {attempts} tries")

    def record_event(self, obj: T, kind: EventType, reason: str, message: str) -> None:
        """A core/v1 Event about ``obj`` (``kubectl describe`` shows it); a failure is logged, not raised:
        events are a courtesy, the status is the record."""
        involved = {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "uid": obj.uid,
            "resourceVersion": obj.resource_version,
        }
        record_event(self._core, obj.namespace, obj.name, involved, kind, reason, message)


class ListedObjectApi(CustomObjectApi[T, S]):
    """A custom resource its controller lists every pass (level-triggered: ExpertQuarantine, ExpertGroup) and
    deletes: the list and the delete, beside the calls every resource has."""

    def list(self, namespace: str) -> list[T]:
        with api_errors(f"list {self.plural}"):
            doc = self._custom.list_namespaced_custom_object(GROUP, VERSION, namespace, self.plural)
        return [type(self).parse(item) for item in doc.get("items") or ()]

    def delete(self, obj: T) -> None:
        """Gone already (404) is done too."""
        with api_errors(f"delete {self.plural}/{obj.name}"):
            try:
                self._custom.delete_namespaced_custom_object(GROUP, VERSION, obj.namespace, self.plural, obj.name)
            except ApiException as err:
                if err.status != 404:
                    raise


class ExpertMigrationApi(CustomObjectApi[ExpertMigration, MigrationStatus]):
    kind, plural, parse = KIND, PLURAL, ExpertMigration.from_dict

    def list(self, namespace: str) -> Listing:
        with api_errors(f"list {PLURAL}"):
            doc = self._custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        items = tuple(ExpertMigration.from_dict(item) for item in doc.get("items") or ())
        return Listing(items, str((doc.get("metadata") or {}).get("resourceVersion", "")))

    def watch(
        self, namespace: str, resource_version: str, timeout_s: int, name: str | None = None
    ) -> Iterator[WatchEvent]:
        """Changes after ``resource_version`` until the server ends the watch (``timeout_s``).

        Raises WatchExpired on 410 Gone. ``name`` watches one object (a field selector)."""
        options = {"field_selector": f"metadata.name={name}"} if name else {}
        with api_errors(f"watch {PLURAL}"):
            response = self._custom.list_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                watch=True,
                resource_version=resource_version,
                timeout_seconds=timeout_s,
                allow_watch_bookmarks=True,
                _preload_content=False,
                _request_timeout=(10, timeout_s + 30),  # (connect, read): a silent connection is not waited on forever
                **options,
            )
        try:
            with api_errors(f"watch {PLURAL}"):
                for line in iter_resp_lines(response):
                    event = json.loads(line)
                    kind, body = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        if body.get("code") == _HTTP_GONE:
                            raise WatchExpired(body.get("message", "resource version too old"))
                        raise KubeApiError(
                            f"watch {PLURAL}: {body.get('code')} {body.get('reason')}: {body.get('message')}"
                        )
                    version = str((body.get("metadata") or {}).get("resourceVersion", resource_version))
                    yield WatchEvent(kind, version, None if kind == "BOOKMARK" else ExpertMigration.from_dict(body))
        finally:
            response.release_conn()


def record_event(
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    name: str,
    involved: dict,
    kind: EventType,
    reason: str,
    message: str,
) -> None:
    """A core/v1 Event about the object ``name`` (``involved``: its apiVersion, kind, uid, resourceVersion);
    a failure is logged, not raised."""
    now = rfc3339(time.time())
    body = {
        "metadata": {"generateName": f"{name}.", "namespace": namespace},
        "involvedObject": {**involved, "name": name, "namespace": namespace},
        "type": kind.value,
        "reason": reason,
        "message": message[:1024],
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": socket.gethostname(),
    }
    try:
        with api_errors("create event"):
            core.create_namespaced_event(namespace, body)
    except KubeApiError as err:
        log.warning("could not record event %s for %s/%s: %s", reason, namespace, name, err)


def create_migration_object(
    api: ExpertMigrationApi,
    spec: MigrationSpec,
    *,
    origin: Origin,
    namespace: str | None = None,
    name: str | None = None,
    initiator: str = "",
    migration_id: str = "",
) -> ExpertMigration:
    """Ask for a migration the Kubernetes way: a new ExpertMigration object (in ``api``'s namespace
    unless ``namespace``), which the orchestrator's controller runs and reports on; ``initiator``
    (e.g. ``drift:<trigger>``) becomes the record's initiator. With ``migration_id`` (a record the
    caller submitted to the runner itself) the controller only reports on that record. The API
    server checks the spec against the CRD's schema (422 -> KubeApiError naming the field)."""
    body = manifest(spec, origin=origin, name=name, initiator=initiator, migration_id=migration_id)
    return api.create(namespace or api.namespace, body)
