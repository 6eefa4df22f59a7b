"""Early health rounds on routers' anomalies: routers with ``anomaly_action`` health_round publish an
``AnomalyRecord`` when an anomaly starts (the store's ``anomalies``); ``AnomalyRounds.update``, a control-loop
manager every ``anomaly_poll_s``, reads them and runs ``HealthMonitor.update(only=pairs)`` on the implicated
experts' replicas, which quarantines where the round's checks confirm (the monitor's own judge), without waiting
for the next ``interval_s`` round. ``decide`` is the pure part.

Glossary
- *new record*: one whose (router, seq) this orchestrator has not acted on and that started at most
  ``anomaly_max_age_s`` ago (one read late, or left from before a restart, is old news: the regular rounds cover it).
- *cooldown*: an expert probed early is not probed early again for ``anomaly_cooldown_s``, however often its
  signal flaps; the regular rounds still check it.

Example: ``decide(records, seen={}, probed={}, now=100.0, cooldown_s=300, max_age_s=600)`` -> ``Decision`` with the
pairs to probe, the records that asked for them, and the (router -> seq) seen after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from expertmesh.orchestrator.health.monitor import HealthMonitor, HealthRound
from expertmesh.orchestrator.health.state import HealthState, Pair
from expertmesh.store import AnomalyRecord, StateStore

__all__ = ["AnomalyRounds", "Decision", "decide"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    #: the (layer, expert) pairs an early round probes now, ascending (empty: no round)
    pairs: tuple[Pair, ...]
    #: the new records that asked for at least one of them
    causes: tuple[AnomalyRecord, ...]
    #: router id -> the highest seq read of it (acted on, or old news)
    seen: dict[str, int]


def decide(
    records: Iterable[AnomalyRecord],
    seen: Mapping[str, int],
    probed: Mapping[Pair, float],
    now: float,
    cooldown_s: float,
    max_age_s: float,
) -> Decision:
    """Which pairs the records not seen yet ask an early round for: new records' pairs, less those probed early
    (``probed``: pair -> when) within ``cooldown_s``."""
    after = dict(seen)
    pairs: set[Pair] = set()
    causes = []
    for record in records:
        after[record.router_id] = max(after.get(record.router_id, 0), record.seq)
        if record.seq <= seen.get(record.router_id, 0) or now - record.at > max_age_s:
            continue
        fresh = {p for p in record.pairs if now - probed.get(p, -float("inf")) >= cooldown_s}
        if fresh:
            pairs |= fresh
            causes.append(record)
    return Decision(tuple(sorted(pairs)), tuple(causes), after)


class AnomalyRounds:
    """The control loop's manager of early rounds (see the module). One thread calls ``update``."""

    def __init__(self, monitor: HealthMonitor, store: StateStore, clock: Callable[[], float] = time.time):
        self._monitor = monitor
        self._store = store
        self._clock = clock
        self._seen: dict[str, int] = {}
        #: pair -> when an early round last probed it
        self._probed: dict[Pair, float] = {}

    def update(self) -> HealthRound | None:
        """Read the records; an early round on what the new ones implicate (None: nothing to do)."""
        config = self._monitor.config
        now = self._clock()
        decision = decide(
            self._store.anomalies(), self._seen, self._probed, now, config.anomaly_cooldown_s, config.anomaly_max_age_s
        )
        self._seen = decision.seen
        self._probed = {p: at for p, at in self._probed.items() if now - at < config.anomaly_cooldown_s}
        if not decision.pairs:
            return None
        for pair in decision.pairs:
            self._probed[pair] = now
        cause = "; ".join(r.describe() for r in decision.causes)
        log.warning(
            "health: early round on layer/expert %s after an anomaly (%s)",
            [f"{layer}/{expert}" for layer, expert in decision.pairs],
            cause,
            extra={"health": {"early_round": [list(p) for p in decision.pairs], "cause": cause}},
        )
        round_ = self._monitor.update(only=decision.pairs, cause=cause)
        quarantined = sorted(
            rid.describe()
            for rid in round_.findings
            if round_.records[rid].state is HealthState.QUARANTINED and round_.records[rid].since == round_.at
        )
        if quarantined:
            log.warning("health: the early round quarantined %s (anomaly: %s)", ", ".join(quarantined), cause)
        return round_
