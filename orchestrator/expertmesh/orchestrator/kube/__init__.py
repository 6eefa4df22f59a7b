"""Kubernetes face of the control plane: the ``ExpertMigration``, ``ExpertQuarantine``
and ``ExpertGroup`` custom resources (``expertmesh.io/v1alpha1``), their
controllers inside ``expertmesh orchestrator``, and the ``kubectl expertmesh`` plugin.

Every move, manual or automatic, is an object, so ``kubectl get expertmigrations``
lists them all; the object is only the request and the report: the work is done
by the one ``MigrationExecutor`` every caller shares (through ``MigrationRunner``),
whose record in the state store stays the source of truth.

Modules, one job each:

``resource``
    The custom resource as typed Python (spec, status, conditions) and its JSON.
``conditions``
    Pure: a migration record -> the object's status (conditions, times, versions).
``api``
    The Kubernetes API calls: connect (service account or kubeconfig), get, list,
    watch (410 Gone surfaces as ``WatchExpired``), create, status writes that retry
    a resourceVersion conflict, Events; ``create_migration_object`` for the drift
    controller and the plugin.
``controller``
    The watch loop that admits new objects to the runner and writes each record's
    progress back to its object's status, with one Event per phase change.
``experts``
    Pure: the routing table and the routers' load -> ``kubectl expertmesh experts`` rows.
``quarantine``
    The ``ExpertQuarantine`` resource as typed Python, and its status as a pure
    function of the health monitor's replica records.
``quarantine_controller``
    Its API calls and the level-triggered loop: a created object quarantines, a
    deleted one releases, every quarantine made elsewhere gets a mirror object,
    status and Events follow the replicas.
``polling``
    The thread both level-triggered controllers run on (quarantines, groups): a pass every few seconds, errors
    logged and retried.
``groups``
    Expert groups, the chart's and those added live, each a Serve application of the RayService's
    ``serveConfigV2``, added and removed live (``KubeRayGroups``, the orchestrator's launcher with ``--ray-service``).
``group_objects``
    The ``ExpertGroup`` resource as typed Python, and what its controller does given the
    objects and the group records (``plan``: add, remove, mirror, refuse, delete), pure.
``group_objects_controller``
    Its API calls and the level-triggered loop: a created object adds its group, a deleted one
    removes it, a group added another way gets a mirror object, status and Events follow the
    group's lifecycle; an add or removal refused for now is tried again every pass.
``plugin``
    ``kubectl-expertmesh``: ``migrate`` (create an object, ``--wait`` follows it)
    and ``experts``.

Glossary
--------
object
    One ``ExpertMigration`` in the API server: a spec (layer, expert, from, to,
    mode) and the status this package writes.
record
    The executor's ``Migration`` in the state store. An object's record id is
    derived from the object's uid (``migration_id_for``) and written to
    ``status.migrationId``, so a restarted orchestrator finds the record again
    instead of starting the move a second time.
finished
    An object whose ``Succeeded`` or ``Failed`` condition is True; the controller
    never touches it again.
"""
