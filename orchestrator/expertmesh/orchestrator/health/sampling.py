"""Which MoE layers one health round probes, within a budget of probe rows (pure).

Glossary
--------
probe rows
    Hidden states one round sends: ``tokens`` per replica checked. They set the round's bytes
    (rows x hidden size x dtype, out and back) and the monitor's CPU (one summary per replica).
budget
    ``HealthConfig.round_probe_rows``; 0 probes every replica every round (the default).

A round takes whole layers, so every replica of an expert is judged on the same probe in the same
round (the deviation between replicas and a probe's refresh need all of them). First every layer
that must be checked now: one with a replica never checked, not healthy (suspect, probation,
quarantined) or withdrawn; then the layers whose longest-unchecked replica waited longest (ties:
lowest layer), while the budget lasts; at least one layer per round. So with every replica healthy,
each is checked within ``ceil(layers / layers per round)`` rounds.

Example: ``layers_for_round(targets, records, tokens=1000, budget_rows=1_000_000)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from expertmesh.orchestrator.health.state import HealthState, ReplicaId, ReplicaRecord

__all__ = ["layers_for_round"]


def _urgent(record: ReplicaRecord | None) -> bool:
    return record is None or record.last_check <= 0 or record.state is not HealthState.HEALTHY or record.withdrawn


def layers_for_round(
    targets: Sequence[ReplicaId], records: Mapping[ReplicaId, ReplicaRecord], tokens: int, budget_rows: int
) -> list[int]:
    """The layers of ``targets`` (the replicas a full round would probe) this round probes, ascending."""
    by_layer: dict[int, list[ReplicaId]] = {}
    for rid in targets:
        by_layer.setdefault(rid.layer, []).append(rid)
    if budget_rows <= 0:
        return sorted(by_layer)
    chosen = [layer for layer, rids in by_layer.items() if any(_urgent(records.get(rid)) for rid in rids)]
    spent = sum(len(by_layer[layer]) * tokens for layer in chosen)
    stalest = sorted(
        (min(records[rid].last_check for rid in rids), layer) for layer, rids in by_layer.items() if layer not in chosen
    )
    for _, layer in stalest:
        cost = len(by_layer[layer]) * tokens
        if chosen and spent + cost > budget_rows:
            break
        chosen.append(layer)
        spent += cost
    return sorted(chosen)
