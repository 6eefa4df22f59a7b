"""The control loop's ``retention`` manager: deletes the finished migration and group records ``policy.expired``
names and the records of routers gone (``policy.routers_gone``, stale load pulses), and logs how many went."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from expertmesh.contracts.load_report import stale_routers
from expertmesh.orchestrator.elastic.state import GroupPhase, GroupRecord
from expertmesh.orchestrator.migration.state import load_all
from expertmesh.orchestrator.retention.policy import expired, routers_gone
from expertmesh.store import StateStore

log = logging.getLogger(__name__)


class RetentionConfig(BaseSettings):
    """From ``EXPERTMESH_RETENTION_<FIELD>`` variables (e.g. ``EXPERTMESH_RETENTION_KEEP_S=604800``)."""

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_RETENTION_", extra="forbid")

    keep_s: float = Field(86_400.0, gt=0, description="seconds a finished migration or group record is kept")
    keep_at_most: int = Field(
        5_000, ge=1, le=1_000_000, description="finished records of each kind kept at the most (the oldest go first)"
    )
    interval_s: float = Field(600.0, gt=0, description="seconds between the manager's rounds")
    router_gone_s: float = Field(
        1200.0, ge=60, description="a router whose heartbeat is older than this is gone: its records are deleted"
    )


class RecordRetention:
    """``update()``: one round. ``protect_s``: the longest cooldown that reads recent moves (drift's, capacity's);
    ``forget_group``: drops a deleted group record from the group controller's memory too."""

    def __init__(
        self,
        store: StateStore,
        config: RetentionConfig,
        protect_s: float,
        forget_group: Callable[[str], None] = lambda name: None,
        clock: Callable[[], float] = time.time,
    ):
        self._store = store
        self.config = config
        self._protect_s = protect_s
        self._forget_group = forget_group
        self._clock = clock

    def update(self) -> tuple[int, int]:
        """Deletes what has expired; returns (migration records, group records) deleted."""
        now, c = self._clock(), self.config
        finished = [(m.id, m.completed_at or m.started_at) for m in load_all(self._store) if m.phase.terminal]
        migrations = expired(finished, now, c.keep_s, c.keep_at_most, self._protect_s)
        for migration_id in migrations:
            self._store.remove_migration(migration_id)
        groups = expired(self._stopped_groups(), now, c.keep_s, c.keep_at_most, self._protect_s)
        for name in groups:
            self._store.remove_group_record(name)
            self._forget_group(name)
        if migrations or groups:
            log.info(
                "retention: deleted %d finished migration records and %d stopped group records (kept %g s, "
                "at most %d of each)",
                len(migrations),
                len(groups),
                c.keep_s,
                c.keep_at_most,
            )
        self.forget_routers(now)
        return len(migrations), len(groups)

    def forget_routers(self, now: float) -> list[str]:
        """Deletes every record of the routers gone; returns their ids."""
        beats = self._store.router_heartbeats()
        silent = routers_gone(((r, b.at) for r, b in beats.items()), now, self.config.router_gone_s)
        stale = [r for r in stale_routers(self._store.loads(), now) if r not in beats]
        gone = sorted({*silent, *stale})
        if not gone:
            return []
        table = self._store.routing_table()
        layers = sorted({layer for layer, _ in table.replicas}) if table is not None else []
        for router in gone:
            self._store.remove_router_heartbeat(router)
            self._store.remove_load(router)
            self._store.remove_hidden_samples(router, layers)
            self._store.remove_anomalies(router)
        log.info(
            "retention: deleted the records of %d routers gone: %s", len(gone), ", ".join(r[:64] for r in gone[:8])
        )
        return gone

    def _stopped_groups(self) -> list[tuple[str, float]]:
        stopped = []
        for name, raw in self._store.group_records().items():
            try:
                record = GroupRecord.from_json(raw)
            except ValueError:
                continue  # the group controller logs unreadable records
            if record.phase is GroupPhase.STOPPED:
                stopped.append((name, record.finished_at))
        return stopped
