"""An in-process Kubernetes API server for the controller and plugin tests: kmock's
``KubernetesEmulator`` (the mock kopf's own tests use; real HTTP on loopback, the
real URL layout, discovery, Status errors) plus the API-server behaviours the code
under test relies on and kmock leaves out:

- metadata the server owns: ``uid``, ``creationTimestamp``, ``generation`` (bumped
  when the spec changes), a cluster-wide increasing ``resourceVersion`` on every
  write, ``generateName``;
- custom resources validated on create against the CRD's ``openAPIV3Schema``
  (422 Invalid naming the field), with schema defaults applied, as the real
  server does;
- the ``status`` subresource: a write to ``/status`` changes only ``status``, a
  write to the object never does, and ``status`` is dropped on create;
- optimistic concurrency: a merge patch carrying a stale
  ``metadata.resourceVersion`` is answered 409 Conflict;
- patch content types: merge patch; strategic merge patch only for built-in
  kinds (415 for custom resources, as the real server answers);
- watch from a ``resourceVersion`` replays what changed after it, honours
  ``timeoutSeconds`` and ``fieldSelector=metadata.name=…``, and answers an ERROR
  event with code 410 Gone once that version has been compacted away.

``ApiServer`` runs it on its own event loop in a thread, so the (synchronous)
``kubernetes`` client in the code under test talks to it over HTTP, and tests can
compact history, drop open watches, or make a concurrent write land between a
client's read and its write (``interfere_once``).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import secrets
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attrs
import jsonschema
import kmock
import yaml
from kmock._internal import enums, references
from kmock._internal.dicts import merge_patch_dict

#: what kinds this fake serves besides CRDs: (group/version/plural, kind, namespaced)
BUILTINS = [("v1/events", "Event", True), ("v1/nodes", "Node", False)]


@dataclass
class _Change:
    resource_version: int
    resource: references.resource
    type: str
    object: dict


def _status(code: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details={})


def _apply_defaults(schema: dict, value: Any) -> None:
    """Fill ``default``s of object properties, recursively (the API server's structural defaulting)."""
    if not isinstance(value, dict):
        return
    for name, prop in (schema.get("properties") or {}).items():
        if name not in value and "default" in prop:
            value[name] = copy.deepcopy(prop["default"])
        if name in value:
            _apply_defaults(prop, value[name])


@attrs.define(kw_only=True)
class FakeKube(kmock.KubernetesEmulator):
    _schemas: dict = attrs.field(factory=dict, init=False)
    _kinds: dict = attrs.field(factory=dict, init=False)
    _with_status: set = attrs.field(factory=set, init=False)
    _version: int = attrs.field(default=100, init=False)
    _changes: list = attrs.field(factory=list, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    _watch_epoch: int = attrs.field(default=0, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    _writing: asyncio.Lock | None = attrs.field(default=None, init=False)
    _interference: list = attrs.field(factory=list, init=False)
    #: how many writes were answered 409 Conflict, and watches 410 Gone
    conflicts: int = attrs.field(default=0, init=False)
    expired: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind, namespaced in BUILTINS:
            self.resources[key] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, verbs={"get", "list", "watch", "create", "patch"}
            )
            self._kinds[references.resource(key)] = kind

    async def __aenter__(self):
        self._changed, self._writing = asyncio.Condition(), asyncio.Lock()
        return await super().__aenter__()

    # -- set-up (called on the server's loop) ------------------------------------------------------

    def install_crd(self, crd: dict) -> None:
        names, spec = crd["spec"]["names"], crd["spec"]
        for version in spec["versions"]:
            resource = references.resource(f"{spec['group']}/{version['name']}/{names['plural']}")
            subresources = set(version.get("subresources") or {})
            self.resources[resource] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular"),
                namespaced=spec["scope"] == "Namespaced",
                shortnames=set(names.get("shortNames") or ()),
                subresources=subresources,
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            )
            self._schemas[resource] = version["schema"]["openAPIV3Schema"]
            self._kinds[resource] = names["kind"]
            if "status" in subresources:
                self._with_status.add(resource)

    def put(self, resource: str, doc: dict) -> dict:
        """Store an object as a create would (no schema check): for test set-up."""
        res = references.resource(resource)
        doc = copy.deepcopy(doc)
        self._stamp_new(res, doc, doc["metadata"].get("namespace"))
        self._objects[res, doc["metadata"].get("namespace"), doc["metadata"]["name"]] = doc
        self._log(res, "ADDED", doc)
        return doc

    def expire_history(self) -> None:
        """Forget every change so far and end open watches, as an API server does when its watch
        cache is compacted: a watch resumed from an older resourceVersion gets 410 Gone."""
        self._compacted = self._version
        self._changes.clear()
        self._watch_epoch += 1
        self._notify()

    def interfere_once(self, matches: Callable[[kmock.Request], bool], change: Callable[[dict], None]) -> None:
        """Before the next request that ``matches`` is served, apply ``change`` to its object as a
        separate write (another client's), so the request's resourceVersion is stale."""
        self._interference.append((matches, change))

    # -- requests -------------------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request):
        writes = (enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE)
        if request.resource is None or request.action not in writes:
            return await super()._handle(request)
        assert self._writing is not None
        async with self._writing:
            try:
                if request.action is enums.action.CREATE:
                    self._admit_create(request)
                elif request.action is enums.action.UPDATE:
                    self._admit_patch(request)
            except kmock.KubernetesError as err:
                return await self._render_error(err)
            response = await super()._handle(request)
            if response.status < 300:
                self._record(request)
                if request.action is enums.action.CREATE and not response.prepared:
                    response.set_status(201, "Created")
            return response

    def _stamp_new(self, resource, doc: dict, namespace: str | None) -> None:
        meta = doc.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta.pop("generateName") + secrets.token_hex(3)[:5]
        if namespace and self.resources[resource].namespaced:
            meta["namespace"] = namespace
        meta.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            generation=1,
            resourceVersion=self._next_version(),
        )
        doc.setdefault("apiVersion", resource.group and f"{resource.group}/{resource.version}" or resource.version)
        doc.setdefault("kind", self._kinds.get(resource, resource.plural))

    def _admit_create(self, request: kmock.Request) -> None:
        doc, resource = request.data, request.resource
        if not isinstance(doc, dict):
            raise _status(400, "BadRequest", "the body is not a JSON object")
        if resource in self._with_status:
            doc.pop("status", None)
        schema = self._schemas.get(resource)
        if schema is not None:
            _apply_defaults(schema, doc)
            self._validate(resource, schema, doc)
        key = (resource, request.namespace, doc.get("metadata", {}).get("name"))
        if key in self._objects and not self._objects[key].deleted:
            return  # kmock answers 409 AlreadyExists
        self._stamp_new(resource, doc, request.namespace)

    def _admit_patch(self, request: kmock.Request) -> None:
        resource, patch = request.resource, request.data
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        custom = resource in self._schemas
        allowed = {"application/merge-patch+json"} | (set() if custom else {"application/strategic-merge-patch+json"})
        if content_type not in allowed:
            raise _status(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types include: "
                f"{', '.join(sorted(allowed))}",
            )
        key = (resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return  # kmock answers 404
        for i, (matches, change) in enumerate(self._interference):
            if matches(request):
                del self._interference[i]
                self._write_aside(key, change)
                break
        current = self._objects[key].raw
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            self.conflicts += 1
            raise _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {resource.plural}.{resource.group} "{request.name}": '
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        meta = {k: v for k, v in (patch.get("metadata") or {}).items() if k in ("labels", "annotations")}
        self._rewrite_patch(request, current, meta)

    def _rewrite_patch(self, request: kmock.Request, current: dict, meta: dict) -> None:
        """Keep only what this endpoint may change; stamp a new resourceVersion (and generation)."""
        raw = dict(request.data) if isinstance(request.data, dict) else {}
        patch = request.data
        patch.clear()
        if request.subresource == "status":
            patch["status"] = raw.get("status")
        else:
            patch.update({k: v for k, v in raw.items() if k not in ("metadata", "status", "apiVersion", "kind")})
            if request.resource not in self._with_status and "status" in raw:
                patch["status"] = raw["status"]
        schema = self._schemas.get(request.resource)
        if schema is not None:  # the result, status included, must still fit the schema
            self._validate(request.resource, schema, merge_patch_dict(copy.deepcopy(current), patch))
        generation = current["metadata"].get("generation", 1)
        if "spec" in patch and merge_patch_dict(
            copy.deepcopy(current.get("spec") or {}), patch["spec"] or {}
        ) != current.get("spec"):
            generation += 1
        patch["metadata"] = {**meta, "resourceVersion": self._next_version(), "generation": generation}

    def _validate(self, resource, schema: dict, doc: dict) -> None:
        kind, meta = self._kinds[resource], doc.get("metadata", {})
        try:
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError as err:
            where = ".".join(str(p) for p in err.absolute_path)
            name = meta.get("name") or meta.get("generateName", "")
            raise _status(
                422,
                "Invalid",
                f'{kind}.{resource.group} "{name}" is invalid: {where}: Invalid value: {err.instance!r}: {err.message}',
            ) from None

    def _write_aside(self, key, change: Callable[[dict], None]) -> None:
        doc = copy.deepcopy(self._objects[key].raw)
        change(doc)
        doc["metadata"]["resourceVersion"] = self._next_version()
        self._objects[key].patch(doc)
        self._log(key[0], "MODIFIED", self._objects[key].raw)

    def _record(self, request: kmock.Request) -> None:
        resource = request.resource
        if request.action is enums.action.CREATE:
            name = request.data["metadata"]["name"]
            namespace = request.data["metadata"].get("namespace")
            self._log(resource, "ADDED", self._objects[resource, namespace, name].raw)
        elif request.action is enums.action.UPDATE:
            self._log(resource, "MODIFIED", self._objects[resource, request.namespace, request.name].raw)
        else:
            obj = self._objects[resource, request.namespace, request.name]
            self._log(resource, "DELETED", obj.last.raw)

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _log(self, resource, kind: str, doc: dict) -> None:
        version = int(doc["metadata"]["resourceVersion"]) if kind != "DELETED" else int(self._next_version())
        self._changes.append(_Change(version, resource, kind, copy.deepcopy(doc)))
        self._notify()

    def _notify(self) -> None:
        async def wake() -> None:
            assert self._changed is not None
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    # -- reads --------------------------------------------------------------------------------------

    @staticmethod
    def _selected(request: kmock.Request, doc: dict) -> bool:
        meta = doc.get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        selector = request.params.get("fieldSelector", "")
        for term in filter(None, selector.split(",")):
            field, _, value = term.partition("=")
            if field == "metadata.name" and meta.get("name") != value:
                return False
        return True

    async def _serve_list(self, request: kmock.Request):
        listed = await super()._serve_list(request)
        items = [doc for doc in listed["items"] if self._selected(request, doc)]
        return {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._version)}, "items": items}

    async def _serve_watch(self, request: kmock.Request):
        yield b""  # headers out: the client sees the stream start
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = loop.time() + timeout
        epoch = self._watch_epoch
        since = request.params.get("resourceVersion") or "0"
        if since == "0":
            position = self._version
            for (resource, namespace, name), obj in list(self._objects.items()):
                if resource == request.resource and not obj.deleted and self._selected(request, obj.raw):
                    yield {"type": "ADDED", "object": copy.deepcopy(obj.raw)}
        else:
            position = int(since)
            if position < self._compacted:
                self.expired += 1
                yield {
                    "type": "ERROR",
                    "object": {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": f"too old resource version: {position} ({self._compacted})",
                        "reason": "Expired",
                        "code": 410,
                    },
                }
                return
        while True:
            if epoch != self._watch_epoch:
                return
            fresh = [c for c in self._changes if c.resource_version > position]
            for change in fresh:
                position = change.resource_version
                if change.resource == request.resource and self._selected(request, change.object):
                    yield {"type": change.type, "object": change.object}
            if fresh:
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=remaining)
                except TimeoutError:
                    return


class ApiServer:
    """``FakeKube`` on 127.0.0.1 in a thread of its own; ``call`` runs a function on its loop."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.fake, self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    async def _start(self):
        self._stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        self._main_task = asyncio.get_running_loop().create_task(self._main(started))
        return await started

    async def _main(self, started) -> None:
        async with FakeKube() as fake, kmock.Server(fake) as server:
            started.set_result((fake, f"http://{server.host}:{server.port}"))
            assert self._stop is not None
            await self._stop.wait()

    def call(self, fn: Callable[..., Any], *args) -> Any:
        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def kubeconfig(self, directory: Path, namespace: str) -> Path:
        path = directory / "kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "t0ken"}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": namespace}}
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    def history(self, resource: str, namespace: str, name: str) -> list[dict]:
        """Every stored version of one object, oldest first."""
        return self.call(
            lambda: [
                copy.deepcopy(v.raw) for v in self.fake.objects[resource, namespace, name].history if v is not None
            ]
        )

    def requests(self) -> list[tuple[str, str]]:
        """(method, path?query) of every request served so far."""
        return self.call(lambda: [(str(r.method.value).upper(), str(r.url.path_qs)) for r in self.fake])

    def close(self) -> None:
        async def stop():
            assert self._stop is not None
            self._stop.set()
            await self._main_task

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=120)  # a loaded machine is slow to stop
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
