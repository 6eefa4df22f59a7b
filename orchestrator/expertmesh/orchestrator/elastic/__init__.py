"""Elastic expert capacity: expert groups added and removed while routers keep serving.

Split like ``orchestrator.migration``: ``state`` (a group's lifecycle record and the
checks on a change, pure), ``plan`` (which live moves fill or drain a group, from the
incremental planner; pure) and ``controller`` (the I/O: starting and stopping group
processes through the platform's launcher, running the moves through the one
``MigrationRunner``). Every expert moves by the existing make-before-break migration;
nothing else restarts, and routers pick a new group up from the routing table.

Glossary
--------
lifecycle
    STARTING (its process starts, empty, and registers) -> FILLING (the planner's moves
    put experts on it) -> SERVING; a removal: SERVING -> DRAINING (every expert moved or
    evicted off it, make before break) -> STOPPED (no table names it, its process ended).
    FAILED: a change that could not finish; the reason says what is left where.
launcher
    What starts and stops a group on this platform (``controller.GroupLauncher``): a
    deployment of the Ray Serve groups application (``platform.ray_groups``, the default
    ``up``) or a plain process (``platform.group_processes``, ``up --groups-as process``).
    On Kubernetes: an application of one group added to the RayService's serveConfigV2
    (``orchestrator.kube.groups``). The orchestrator never starts a process itself.
change
    One add or remove; one runs at a time per orchestrator. Asked for through the admin API (the CLI, the
    kubectl plugin), by the capacity controller, or on Kubernetes by an ExpertGroup object
    (``orchestrator.kube.group_objects_controller``, which tries a refused one again).
"""
