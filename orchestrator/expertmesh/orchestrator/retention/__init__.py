"""Finished records the orchestrator keeps in the state store, and for how long: what stops the ``migrations``
and ``groups`` hashes growing with every move and every group change for the deployment's whole life.

Glossary
- *finished record*: a migration in a terminal phase (``completed_at`` set), a group STOPPED (``finished_at``).
  Records in flight are never touched.
- *keep_s*: a finished record is kept this long after it finished (``migrate list``, ``groups list``, an
  ExpertMigration's status, the log of what drift did); then deleted.
- *keep_at_most*: finished records kept of each kind at the most; the oldest past it go early, but never one
  younger than *protect_s* (the drift and capacity cooldowns read recent moves: an expert moved within the cooldown
  stays put, and would move again were its record gone).
- *router gone*: a router whose heartbeat is older than *router_gone_s* (it beats every second), or whose load
  pulse is stale (``contracts.load_report``: written two windows ago; a router from before heartbeats were kept, or
  one stopped). Its records go: heartbeat, load pulse and detail, hidden-state samples, anomaly records. Routers
  that come and go (pods rescheduled under new names, crashes) otherwise leave them for ever, and a stale heartbeat
  counts in every router's inflow budget (``StateStore.router_count``).

Why: every migration submit, every drift and capacity scan and every ``migrate list`` read the whole ``migrations``
hash; at a thousand moves a day (``bench scale``'s drifting day at 64 GPUs) a year kept them all would make each read
hundreds of MB.

Modules: ``policy`` (which records go: a pure function of ids and times), ``manager`` (the control loop's manager
that reads the store, deletes and logs).
"""

from expertmesh.orchestrator.retention.manager import RecordRetention, RetentionConfig

__all__ = ["RecordRetention", "RetentionConfig"]
