"""``bench serve --redundant R``: the experts placed by their measured load before the timed runs.

The contiguous split the benchmarks start with is nobody's placement: a deployment places experts by
the load its routers measure (``expertmesh plan`` from ``stats export``, drift while it serves). Here,
on the platform started in-process, before any timed request:

1. calibration: prompts of the run's shape from another seed through the platform, which its router
   counts in its load window;
2. the plan: the placement planner over the expert groups (the groups as the GPUs of one island, with
   ``R`` more replicas per layer, ``drift.rebalance.LayerLoads.planned_placement``);
3. carried out live, make before break, as a changed placement file is (``reconcile.placement_steps``:
   replicate, then evict), each step through the migration executor.

The router then levels each step's work across a replicated expert's replicas (``replica_split``).
"""

from __future__ import annotations

import time
from typing import Callable

from expertmesh.bench.report import BenchError
from expertmesh.infra.console import progress

__all__ = ["place_by_load", "placement_line"]


def place_by_load(plane, redundant: int, calibrate: Callable[[], None]) -> dict:
    """Calibrate, plan with ``redundant`` replicas per layer, and move the platform's experts there; a summary
    (JSON: ``placement``)."""
    from expertmesh.orchestrator.drift.observe import expert_loads
    from expertmesh.orchestrator.drift.rebalance import LayerLoads
    from expertmesh.orchestrator.migration.executor import MigrationExecutor
    from expertmesh.orchestrator.migration.state import Phase
    from expertmesh.orchestrator.reconcile import placement_steps

    calibrate()
    snapshot = plane.dispatcher.load_window.snapshot()
    store = plane.store
    before = LayerLoads.build(store.routing_table(), expert_loads(snapshot), store.endpoints())
    desired = before.planned_placement(snapshot.top_k, redundant)
    started, migrations = time.perf_counter(), 0
    executor = MigrationExecutor(store, poll_s=0.05)
    rounds = 2 * len(desired.groups) + 1  # a pair's replicates and evicts take a round each, one per group at most
    try:
        for _ in range(rounds + 1):  # + 1: the look that finds nothing left
            steps = placement_steps(store.routing_table(), desired)
            if not steps:
                break
            for step in steps:
                layer, expert = step.pair
                migration = executor.submit(
                    layer, expert, target=step.target, source=step.source, mode=step.mode, initiator="bench"
                )
                final = executor.run(migration.id)
                if final.phase is not Phase.SUCCEEDED:
                    raise BenchError(
                        f"placing layer {layer} expert {expert}: {step.mode} ended {final.phase}: {final.reason}"
                    )
                migrations += 1
            progress(f"bench serve: {migrations} migrations towards the planned placement")
        else:
            raise BenchError(f"the planned placement was not reached in {rounds} rounds of migrations")
    finally:
        executor.close()
    table = store.routing_table()
    after = LayerLoads.build(table, expert_loads(snapshot), store.endpoints())
    held = sum(len(groups) for groups in table.replicas.values())
    return {
        "redundant": redundant,
        "calibration_tokens": round(float(snapshot.load.sum()) / (max(snapshot.top_k, 1) * snapshot.load.shape[0])),
        "migrations": migrations,
        "seconds": time.perf_counter() - started,
        "balancedness_before": _mean(before.balancedness()),
        "balancedness_after": _mean(after.balancedness()),
        "replicas_per_expert": held / len(table.replicas),
    }


def _mean(by_layer: dict[int, float]) -> float:
    return sum(by_layer.values()) / len(by_layer)


def placement_line(placement: dict) -> str:
    """The table's line about it."""
    return (
        f"placement: planned from {placement['calibration_tokens']} calibration tokens with "
        f"{placement['redundant']} redundant replicas per layer ({placement['replicas_per_expert']:.2f} replicas "
        f"per expert): {placement['migrations']} live migrations in {placement['seconds']:.1f}s; balancedness "
        f"{placement['balancedness_before']:.3f} -> {placement['balancedness_after']:.3f} on the calibration load"
    )
