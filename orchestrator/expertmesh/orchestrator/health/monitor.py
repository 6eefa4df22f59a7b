"""The health monitor: one guarded round (``update``) = observe every group, probe
every replica, judge (``policy``), pin a fresh probe input where one is due
(``probes``), repair what the monitor quarantined before, and settle: publish the
routing table ``policy.plan_table`` asks for, the
records, and the ``quarantine`` entries routers read. ``quarantine`` and
``release`` are the operator's commands; ``start`` runs a round every
``interval_s`` in a thread. ``update(only=pairs)`` is an early round on those
experts' replicas alone (``anomalies``: what routers' anomaly records ask for).

Probing scales with the model: each group gets one Dispatch per layer for all of
its experts' probe rows (split only to stay under ``probe_batch_bytes``), and
groups are observed and probed ``probe_concurrency`` at a time.

Locks: rounds run one at a time (``_round_lock``), and every read-modify-write of
the records, quarantine entries and table edit takes the short ``_state_lock``,
held over store I/O only, never over a group call. So an operator's (or an
ExpertQuarantine's) ``quarantine`` never waits for a round's probes: a round
judges a snapshot of the records and, when it settles, leaves alone any record a
command changed meanwhile (the command's word stands; the next round checks it).
A round survives groups that do not answer (their replicas are not checked this
round, their records stay) and the loop survives a failed round (logged; the next
interval tries again). Every step is safe to repeat: records are rewritten whole,
the table edit is computed afresh from the table in the store and published
compare-and-set.

Memory: the monitor is the one writer of the ``health`` records, the
``quarantine`` entries and the pinned probes, and it keeps its own copy of what it
last wrote. A flushed store (FLUSHDB, a Redis replaced without its data) loses
them; the monitor puts back what the store lost at its next read, and
``restore`` does so on demand: the reconciler calls it before it rebuilds the
routing table of an empty store, so the entries routers read are back before any
table is, and the rebuilt table lists no replica the monitor keeps out of service.
Baselines and probes come back with them, so a replica is judged after a flush
against what it computed before it, never re-baselined on what it computes now.

Recording: a log line per state change (``health`` field in JSON logs), an
event on the ``expertmesh.health.round`` span, and two observable gauges read
at collection from the last settled records: ``expertmesh.expert.health``
{layer, expert} (``policy.SCORE`` of the expert's worst replica: 1 healthy,
0.75 probation, 0.5 suspect, 0 quarantined) and ``expertmesh.expert.kl``
{layer, expert} (the largest KL(baseline || now) among its replicas).
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry.metrics import CallbackOptions, Observation

from expertmesh.contracts.errors import QuarantineRefused
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.infra.telemetry.setup import meter, tracer
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.orchestrator.health import measure, policy, probes, sampling, state
from expertmesh.orchestrator.health.config import HealthConfig
from expertmesh.orchestrator.health.reference import Reference
from expertmesh.orchestrator.health.state import Check, Finding, HealthState, Initiator, Pair, ReplicaId, ReplicaRecord
from expertmesh.orchestrator.migration.group_calls import Fingerprint, GroupCallFailed, GroupChannels, GroupView
from expertmesh.orchestrator.migration.plan import canary_difference, check_all_hosted
from expertmesh.store import QuarantinedReplica, StateStore

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaStatus:
    record: ReplicaRecord
    #: the routing table lists the group for the expert now
    listed: bool


@dataclass(frozen=True)
class HealthRound:
    at: float
    records: Mapping[ReplicaId, ReplicaRecord]
    #: what each replica checked this round showed (empty: clean)
    findings: Mapping[ReplicaId, tuple[Finding, ...]]
    table_version: int
    #: groups that did not answer Describe or Fingerprint; their replicas were not checked
    unreachable: tuple[str, ...]
    #: layer -> the probe input its replicas were checked on ("recorded" or "seeded")
    probes: Mapping[int, str]


@dataclass(frozen=True)
class _Observed:
    view: GroupView
    fingerprints: dict[Pair, Fingerprint]

    def holds(self, pair: Pair) -> bool:
        return pair in self.view.pairs and pair in self.fingerprints


class HealthMonitor:
    def __init__(
        self,
        store: StateStore,
        checkpoint: Checkpoint,
        config: HealthConfig,
        *,
        clock: Callable[[], float] = time.time,
        publish_attempts: int = 5,
    ):
        self.config = config
        self._store = store
        self._clock = clock
        self._publish_attempts = publish_attempts
        self._groups = GroupChannels(store.endpoints)
        self._reference = Reference(checkpoint)
        #: one round at a time
        self._round_lock = threading.Lock()
        #: read-modify-write of records, quarantine entries and the table edit; held over store I/O only
        self._state_lock = threading.Lock()
        #: the records as last settled (the gauges; and what a flushed store gets back)
        self._latest: dict[ReplicaId, ReplicaRecord] = {}
        #: layer -> the probe pinned for it, as last pinned or read (what a flushed store gets back)
        self._pinned: dict[int, probes.Probe] = {}
        m = meter()
        m.create_observable_gauge(
            "expertmesh.expert.health",
            [self._health_gauge],
            description="1 healthy, 0.75 probation, 0.5 suspect, 0 quarantined (worst replica)",
        )
        m.create_observable_gauge(
            "expertmesh.expert.kl",
            [self._kl_gauge],
            description="KL(baseline || now) of the probe output (largest over replicas)",
        )

    # -- one round ----------------------------------------------------------------------------

    def update(self, only: Collection[Pair] | None = None, cause: str = "") -> HealthRound:
        """One round. No routing table in the store, or the store unreachable, raises.

        ``only``: an early round (``anomalies``): the replicas of these (layer, expert) pairs alone, all of them
        whatever ``round_probe_rows`` says, judged and settled as in any round (repairs due among them too); the
        layers' probes are not refreshed (that needs every replica of a layer). ``cause``: why, on the span."""
        wanted = None if only is None else frozenset(only)
        with self._round_lock, tracer().start_as_current_span("expertmesh.health.round") as span:
            if cause:
                span.set_attribute("expertmesh.health.cause", cause)
            now = self._clock()
            table = self._table()
            observed, unreachable = self._observe()
            with self._state_lock:
                before = self._forget_unheld(self._records_now(), observed)
            records = dict(before)
            due = [
                rid
                for rid, r in records.items()
                if policy.wants_repair(r, self.config)
                and rid.group in observed
                and (wanted is None or rid.pair in wanted)
            ]
            targets = self._targets(table, records, observed)
            if wanted is None:
                layers = set(
                    sampling.layers_for_round(targets, records, self.config.tokens, self.config.round_probe_rows)
                )
                targets = [rid for rid in targets if rid.layer in layers]
            else:
                targets = [rid for rid in targets if rid.pair in wanted]
                layers = {rid.layer for rid in targets}
            span.set_attribute("expertmesh.health.layers", len(layers))
            inputs = self._probes(sorted(layers), observed)
            found: dict[ReplicaId, tuple[Finding, ...]] = {}
            for rid, check in self._check(targets, inputs, records, observed, now).items():
                judged = records.get(rid) or ReplicaRecord(rid, since=now)
                after, found[rid] = policy.judge(judged, check, self.config)
                records[rid] = self._note(judged, after, span)
            if wanted is None:
                self._refresh_probes(inputs, targets, records, found, observed, now)
            for rid in due:
                if policy.wants_repair(records[rid], self.config):
                    view = observed[rid.group].view
                    probe = inputs.get(rid.layer) or self._current_probe(rid.layer, view.hidden_size)
                    records[rid] = self._note(records[rid], self._repair(records[rid], view, probe, now), span)
            with self._state_lock:
                records, table = self._settle(self._merged(before, records))
            span.set_attribute("expertmesh.health.checked", len(found))
            recorded = sorted(layer for layer, p in inputs.items() if p.source is probes.ProbeSource.RECORDED)
            span.set_attribute("expertmesh.health.recorded_layers", recorded)
            span.set_attribute("expertmesh.routing_table.version", table.version)
        return HealthRound(
            now, records, found, table.version, unreachable, {layer: p.source.value for layer, p in inputs.items()}
        )

    # -- the records: the store's, and what it lost --------------------------------------------

    def _records_now(self) -> dict[ReplicaId, ReplicaRecord]:
        """(Under ``_state_lock``) the stored records, plus those this monitor settled that the store lost."""
        stored, lost = self._read_records()
        return {**lost, **stored}

    def _read_records(self) -> tuple[dict[ReplicaId, ReplicaRecord], dict[ReplicaId, ReplicaRecord]]:
        """(The stored records, those this monitor settled that the store lacks): this monitor is their one
        writer, so a record it remembers and the store lacks was lost (a flush)."""
        stored = state.load_all(self._store)
        lost = {r: record for r, record in self._latest.items() if r not in stored}
        if lost:
            log.warning(
                "health: the state store lost %d health records (flushed?); restoring them from the monitor's memory",
                len(lost),
            )
        return stored, lost

    def _merged(
        self,
        before: Mapping[ReplicaId, ReplicaRecord],
        after: Mapping[ReplicaId, ReplicaRecord],
        unchanged: Callable[[ReplicaRecord | None, ReplicaRecord | None], bool] = operator.eq,
    ) -> dict[ReplicaId, ReplicaRecord]:
        """(Under ``_state_lock``) the records now, with ``after``'s word for each record that is still as it was
        when the work that made ``after`` began (``before``; ``unchanged(now, then)`` says what counts): a record
        a command changed meanwhile keeps the command's change, and the next round checks it again."""
        current = self._records_now()
        merged = dict(current)
        for r, record in after.items():
            if unchanged(current.get(r), before.get(r)):
                merged[r] = record
            else:
                log.info("health: %s changed meanwhile (a command, or a round); this change of it is dropped", r)
        return merged

    def restore(self) -> frozenset[tuple[int, int, str]]:
        """Put back what the store lost of this monitor's records, quarantine entries and pinned probes (the
        reconciler calls it before it publishes the table of an empty store); returns the (layer, expert,
        group) replicas a rebuilt table must not list: out of service, or withdrawn and not yet put back."""
        with self._state_lock:
            stored, lost = self._read_records()
            records = {**lost, **stored}
            for record in lost.values():
                state.save(self._store, record)
            for record in records.values():
                if record.state.out_of_service:  # the others have no entry to put back
                    self._publish_entry(record)
            self._latest = records
            pinned = self._store.health_probes()
            for layer, probe in sorted(self._pinned.items()):
                if str(layer) not in pinned:
                    probes.pin(self._store, probe)
                    log.warning("health: restored the pinned probe of layer %d (%s)", layer, probe.digest)
        return frozenset(
            (r.layer, r.expert, r.group)
            for r, record in records.items()
            if record.state.out_of_service or record.withdrawn
        )

    def _table(self) -> RoutingTable:
        table = self._store.routing_table()
        if table is None:
            raise QuarantineRefused("no routing table in the state store yet; start the expert groups first")
        return table

    def _each_group(self, call: Callable[[str], T], groups: list[str]) -> dict[str, T | GroupCallFailed]:
        """group -> ``call(group)`` (or the GroupCallFailed it raised), ``probe_concurrency`` groups at a time."""

        def guarded(group: str) -> T | GroupCallFailed:
            try:
                return call(group)
            except GroupCallFailed as err:
                return err

        if not groups:
            return {}
        workers = min(self.config.probe_concurrency, len(groups))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="expertmesh-health") as pool:
            return dict(zip(groups, pool.map(guarded, groups)))

    def _observe(self) -> tuple[dict[str, _Observed], tuple[str, ...]]:
        observed, unreachable = {}, []
        answers = self._each_group(
            lambda group: _Observed(self._groups.describe(group), self._groups.fingerprints(group)),
            sorted(self._store.endpoints()),
        )
        for group, answer in answers.items():
            if isinstance(answer, GroupCallFailed):
                log.warning("health: cannot observe group %s, its replicas wait for the next round: %s", group, answer)
                unreachable.append(group)
            else:
                observed[group] = answer
        return observed, tuple(unreachable)

    def _forget_unheld(
        self, records: dict[ReplicaId, ReplicaRecord], observed: dict[str, _Observed]
    ) -> dict[ReplicaId, ReplicaRecord]:
        """(Under ``_state_lock``) drop the records of replicas whose group answered without the expert (moved or
        evicted), from the store and from memory."""
        for rid in [rid for rid in records if rid.group in observed and not observed[rid.group].holds(rid.pair)]:
            log.info("health: %s is no longer held; forgetting its record (%s)", rid.describe(), records.pop(rid).state)
            state.remove(self._store, rid)
            self._store.clear_quarantined(rid.layer, rid.expert, rid.group)
            self._latest.pop(rid, None)
        return records

    def _targets(
        self, table: RoutingTable, records: Mapping[ReplicaId, ReplicaRecord], observed: dict[str, _Observed]
    ) -> list[ReplicaId]:
        """Every replica the table lists or the monitor withdrew, on a group that holds it."""
        listed = {ReplicaId(layer, e, g) for (layer, e), groups in table.replicas.items() for g in groups}
        withdrawn = {rid for rid, r in records.items() if r.withdrawn}
        return sorted(
            rid for rid in listed | withdrawn if rid.group in observed and observed[rid.group].holds(rid.pair)
        )

    def _current_probe(self, layer: int, hidden_size: int) -> probes.Probe:
        """The layer's pinned probe, or the seeded one."""
        pinned = self._pinned_probes(hidden_size).get(layer)
        return pinned or probes.seeded(layer, hidden_size, self.config.tokens, self.config.seed)

    def _pinned_probes(self, hidden_size: int) -> dict[int, probes.Probe]:
        """layer -> its pinned probe: the store's, and (pinned again) those it lost that this monitor remembers."""
        pinned = probes.load_pinned(self._store, hidden_size)
        for layer, probe in sorted(self._pinned.items()):
            if layer not in pinned and probe.hidden.shape[1] == hidden_size:
                log.warning("health: the state store lost the pinned probe of layer %d; pinning it again", layer)
                probes.pin(self._store, probe)
                pinned[layer] = probe
        self._pinned.update(pinned)
        return pinned

    def _pin(self, probe: probes.Probe) -> None:
        probes.pin(self._store, probe)
        self._pinned[probe.layer] = probe

    def _probes(self, layers: list[int], observed: dict[str, _Observed]) -> dict[int, probes.Probe]:
        if not layers:
            return {}
        hidden_size = next(iter(observed.values())).view.hidden_size
        pinned = self._pinned_probes(hidden_size)
        return {
            layer: pinned.get(layer) or probes.seeded(layer, hidden_size, self.config.tokens, self.config.seed)
            for layer in layers
        }

    def _probe_all(
        self, targets: list[ReplicaId], inputs: Mapping[int, probes.Probe], observed: dict[str, _Observed]
    ) -> dict[ReplicaId, measure.Output]:
        """Each target's output on its layer's probe: per group one Dispatch per layer for all its experts
        (``measure.batches``), groups in parallel. A failed call leaves its replicas out (next round)."""
        by_group: dict[str, dict[int, list[int]]] = {}
        for rid in targets:
            by_group.setdefault(rid.group, {}).setdefault(rid.layer, []).append(rid.expert)

        def probe_group(group: str) -> dict[ReplicaId, measure.Output]:
            view, out = observed[group].view, {}
            for layer, experts in sorted(by_group[group].items()):
                hidden = inputs[layer].hidden.to(view.dtype)  # [T, H]
                tokens = hidden.shape[0]
                row_bytes = hidden.shape[1] * hidden.element_size()
                for chunk in measure.batches(experts, tokens, row_bytes, self.config.probe_batch_bytes):
                    try:
                        got = self._groups.dispatch(
                            group, layer, measure.probe_batch(hidden, chunk)
                        )  # [len(chunk) * T, H]
                    except GroupCallFailed as err:
                        log.warning(
                            "health: probe of layer %d experts %s on %s failed, they wait for the next round: %s",
                            layer,
                            list(chunk),
                            group,
                            err,
                        )
                        continue
                    if tuple(got.shape) != (len(chunk) * tokens, hidden.shape[1]):
                        log.warning(
                            "health: %s answered the probe of layer %d with shape %s; "
                            "its experts wait for the next round",
                            group,
                            layer,
                            list(got.shape),
                        )
                        continue
                    for i, expert in enumerate(chunk):
                        out[ReplicaId(layer, expert, group)] = measure.summarise(got[i * tokens : (i + 1) * tokens])
            return out

        outputs: dict[ReplicaId, measure.Output] = {}
        for answer in self._each_group(probe_group, sorted(by_group)).values():
            outputs.update(answer)  # probe_group catches its own GroupCallFailed
        return outputs

    def _check(
        self,
        targets: list[ReplicaId],
        inputs: Mapping[int, probes.Probe],
        records: Mapping[ReplicaId, ReplicaRecord],
        observed: dict[str, _Observed],
        now: float,
    ) -> dict[ReplicaId, Check]:
        outputs = self._probe_all(targets, inputs, observed)
        by_pair: dict[Pair, dict[str, measure.Output]] = {}
        for rid, output in outputs.items():
            by_pair.setdefault(rid.pair, {})[rid.group] = output
        deviations = {pair: measure.deviations({g: o.norms for g, o in outs.items()}) for pair, outs in by_pair.items()}
        checks = {}
        for rid, output in sorted(outputs.items()):
            seen, probe = observed[rid.group], inputs[rid.layer]
            fingerprint = seen.fingerprints[rid.pair]
            base = policy.current_baseline(records[rid], fingerprint.loaded, probe.digest) if rid in records else None
            checks[rid] = Check(
                at=now,
                fingerprint=fingerprint.loaded,
                fingerprint_intact=fingerprint.intact,
                probe=probe.digest,
                probe_source=probe.source.value,
                probe_non_finite=output.non_finite,
                served_non_finite=seen.view.non_finite_rows.get(rid.pair, 0),
                norm_mean=output.norm_mean,
                kl=measure.divergence(output, base) if base is not None else None,
                # quantiles cost more than the rest of a check: only a replica without a baseline needs one
                candidate=measure.baseline(output, fingerprint.loaded, now, self.config.histogram_bins, probe.digest)
                if base is None
                else None,
                deviation=deviations[rid.pair].get(rid.group),
                replicas=len(by_pair[rid.pair]),
            )
        return checks

    def _refresh_probes(
        self,
        inputs: dict[int, probes.Probe],
        targets: list[ReplicaId],
        records: dict[ReplicaId, ReplicaRecord],
        found: Mapping[ReplicaId, tuple[Finding, ...]],
        observed: dict[str, _Observed],
        now: float,
    ) -> None:
        """Pin the routers' recorded hidden states as the probe of each layer where one is due (seeded now, or
        pinned ``probe_refresh_s`` ago) and every replica was judged healthy on the old probe this round: each
        gets its baseline on the new probe now (``probes``' docstring has why)."""
        for layer, current in sorted(inputs.items()):
            if current.source is probes.ProbeSource.RECORDED and now - current.pinned_at < self.config.probe_refresh_s:
                continue
            fresh = probes.recorded(self._store, layer, current.hidden.shape[1], self.config.tokens, now)
            if fresh is None or fresh.digest == current.digest:
                continue
            layer_records = [r for rid, r in records.items() if rid.layer == layer]
            if not policy.may_change_probe(layer_records, found, current.digest):
                log.info(
                    "health: layer %d keeps its %s probe until every replica of it is healthy", layer, current.source
                )
                continue
            layer_targets = [rid for rid in targets if rid.layer == layer]
            outputs = self._probe_all(layer_targets, {layer: fresh}, observed)
            if set(outputs) != set(layer_targets):
                continue  # a failed call: the next round tries again
            for rid in layer_targets:
                fingerprint = observed[rid.group].fingerprints[rid.pair].loaded
                baseline = measure.baseline(outputs[rid], fingerprint, now, self.config.histogram_bins, fresh.digest)
                records[rid] = policy.rebaselined(records[rid], baseline, fresh.source.value)
            self._pin(fresh)
            inputs[layer] = fresh
            log.info(
                "health: layer %d probes with %d recorded hidden states from now on (%s)",
                layer,
                fresh.hidden.shape[0],
                fresh.digest,
            )

    def _repair(self, record: ReplicaRecord, view: GroupView, probe: probes.Probe, now: float) -> ReplicaRecord:
        """Reload the replica from the checkpoint on its group and verify it against the reference
        computed here on the layer's probe: on probation with the verified output as baseline, or still
        quarantined with the reason."""
        rid = record.replica
        hidden = probe.hidden.to(view.dtype)  # [T, H]
        try:
            self._groups.reload(rid.group, rid.pair)
            out = self._groups.dispatch(rid.group, rid.layer, measure.probe_batch(hidden, (rid.expert,)))  # [T, H]
            fingerprint = self._groups.fingerprints(rid.group, [rid.pair])[rid.pair]
        except GroupCallFailed as err:
            return policy.repair_failed(record, str(err))
        reference = self._reference.output(rid.layer, rid.expert, hidden)  # [T, H]
        difference = canary_difference(reference, out, policy.reference_tolerance(view.dtype))
        if difference is not None:
            return policy.repair_failed(
                record,
                f"reloaded on {rid.group}, but its output differs from the checkpoint's by max |Δ| {difference:.3g}",
            )
        baseline = measure.baseline(
            measure.summarise(out), fingerprint.loaded, now, self.config.histogram_bins, probe.digest
        )
        return policy.repaired(record, baseline, now)

    # -- settling -----------------------------------------------------------------------------------

    def _settle(
        self, records: Mapping[ReplicaId, ReplicaRecord]
    ) -> tuple[dict[ReplicaId, ReplicaRecord], RoutingTable]:
        """(Under ``_state_lock``) publish the table ``records`` ask for, then the records and quarantine entries
        as that table has them; returns both. A table that keeps changing under us is left for the next round."""
        table = self._publish(records)
        settled = policy.mark_withdrawn(records, table)
        for record in settled.values():
            state.save(self._store, record)
            self._publish_entry(record)
        self._latest = settled
        return settled, table

    def _publish_entry(self, record: ReplicaRecord) -> None:
        """The replica's ``quarantine`` entry as its record says: there while out of service, else gone."""
        rid = record.replica
        if record.state.out_of_service:
            self._store.set_quarantined(
                QuarantinedReplica(
                    rid.layer, rid.expert, rid.group, record.state.value, record.reason, record.since, record.withdrawn
                )
            )
        else:
            self._store.clear_quarantined(rid.layer, rid.expert, rid.group)

    def _publish(self, records: Mapping[ReplicaId, ReplicaRecord]) -> RoutingTable:
        for _ in range(self._publish_attempts):
            current = self._table()
            table = policy.plan_table(current, records)
            if table is None:
                return current
            check_all_hosted(current, table)
            if self._store.publish_routing_table(table):
                log.info("health: published routing table v%d", table.version)
                return table
        log.warning("health: the routing table kept changing; its edit waits for the next round")
        return self._table()

    def _note(self, before: ReplicaRecord, after: ReplicaRecord, span) -> ReplicaRecord:
        """Log and trace a change of state."""
        if after.state is not before.state:
            rid = after.replica
            fields = {
                "layer": rid.layer,
                "expert": rid.expert,
                "group": rid.group,
                "from": before.state.value,
                "to": after.state.value,
                "reason": after.reason,
            }
            level = logging.WARNING if after.state is HealthState.QUARANTINED else logging.INFO
            log.log(
                level,
                "health: %s %s -> %s: %s",
                rid.describe(),
                before.state,
                after.state,
                after.reason,
                extra={"health": fields},
            )
            span.add_event("expertmesh.health.transition", {f"expertmesh.health.{k}": v for k, v in fields.items()})
        return after

    # -- operator commands ----------------------------------------------------------------------------

    def listing(self, layer: int | None = None) -> list[ReplicaStatus]:
        """Every replica the table lists or the monitor keeps a record of (never checked: a fresh record)."""
        table = self._table()
        with self._state_lock:
            records = self._records_now()
        listed = {ReplicaId(l, e, g) for (l, e), groups in table.replicas.items() for g in groups}
        return [
            ReplicaStatus(records.get(rid) or ReplicaRecord(rid), rid in listed)
            for rid in sorted(listed | set(records))
            if layer is None or rid.layer == layer
        ]

    def quarantine(
        self, layer: int, expert: int, group: str | None = None, reason: str = "", by: Initiator = Initiator.OPERATOR
    ) -> list[ReplicaStatus]:
        """Take ``group``'s replica (default: every replica) of the expert out of service now; it stays
        quarantined until ``release``. Never waits for a round's probes (``_state_lock`` only)."""
        with self._state_lock, tracer().start_as_current_span("expertmesh.health.quarantine") as span:
            now = self._clock()
            table = self._table()
            pair = (layer, expert)
            if pair not in table.replicas:
                raise QuarantineRefused(f"layer {layer} expert {expert} is not in routing table v{table.version}")
            records = self._records_now()
            known = set(table.replicas[pair]) | {
                rid.group for rid, r in records.items() if rid.pair == pair and r.withdrawn
            }
            if group is not None and group not in known:
                raise QuarantineRefused(
                    f"group {group!r} does not serve layer {layer} expert {expert} (replicas: {sorted(known)})"
                )
            targets = [ReplicaId(layer, expert, g) for g in ([group] if group is not None else table.replicas[pair])]
            for rid in targets:
                before = records.get(rid) or ReplicaRecord(rid, since=now)
                after = policy.quarantine(before, by, reason or "quarantined by an operator", now)
                records[rid] = self._note(before, after, span)
            self._settle(records)
        return self._statuses(targets)

    def release(self, layer: int, expert: int, group: str | None = None) -> list[ReplicaStatus]:
        """Repair the expert's quarantined replicas (on ``group`` only, if given): reload, verify,
        probation. One that fails verification stays quarantined, with the reason. The reloads run outside
        ``_state_lock``, like a round's probes."""
        with tracer().start_as_current_span("expertmesh.health.release") as span:
            now = self._clock()
            with self._state_lock:
                before = self._records_now()
            records = dict(before)
            targets = sorted(
                rid
                for rid, r in records.items()
                if rid.pair == (layer, expert)
                and (group is None or rid.group == group)
                and r.state is HealthState.QUARANTINED
            )
            if not targets:
                where = f" on {group!r}" if group is not None else ""
                raise QuarantineRefused(f"no quarantined replica of layer {layer} expert {expert}{where}")
            for rid in targets:
                try:
                    view = self._groups.describe(rid.group)
                except GroupCallFailed as err:
                    records[rid] = policy.repair_failed(records[rid], str(err))
                    continue
                probe = self._current_probe(rid.layer, view.hidden_size)
                records[rid] = self._note(records[rid], self._repair(records[rid], view, probe, now), span)
            with self._state_lock:
                # A round that ran meanwhile checked the quarantined replicas (new figures, the same quarantine):
                # the repair, made after that, still holds. Only a record that left the quarantine meanwhile
                # (another release) keeps the other change.
                self._settle(self._merged(before, records, policy.same_quarantine))
        return self._statuses(targets)

    def _statuses(self, targets: list[ReplicaId]) -> list[ReplicaStatus]:
        wanted = set(targets)
        return [s for s in self.listing(targets[0].layer) if s.record.replica in wanted]

    # -- gauges -----------------------------------------------------------------------------------------

    def _health_gauge(self, options: CallbackOptions) -> list[Observation]:
        worst: dict[Pair, float] = {}
        for rid, r in self._latest.items():
            worst[rid.pair] = min(worst.get(rid.pair, 1.0), policy.SCORE[r.state])
        return [
            Observation(score, {"layer": layer, "expert": expert}) for (layer, expert), score in sorted(worst.items())
        ]

    def _kl_gauge(self, options: CallbackOptions) -> list[Observation]:
        largest: dict[Pair, float] = {}
        for rid, r in self._latest.items():
            if r.kl is not None:
                largest[rid.pair] = max(largest.get(rid.pair, 0.0), r.kl)
        return [Observation(kl, {"layer": layer, "expert": expert}) for (layer, expert), kl in sorted(largest.items())]

    def close(self) -> None:
        """Close the group channels (the control loop that calls ``update`` stops first)."""
        self._groups.close()
