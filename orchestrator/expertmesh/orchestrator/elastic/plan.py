"""Which live moves fill an added group or drain a removed one: the incremental planner
(``placement.incremental.replan``) over the groups as the GPUs of one island, from where the
routing table has every expert now, turned into migrations. Pure: plain data in and out.

Adding a group is a GPU added (it starts empty, the repair gives it the replicas that
over-full groups give up, the search balances by load; where that leaves it fewer than its
even share of a layer's replicas, the fullest groups give it their least loaded experts
until it has them: an added group always serves); removing one is a GPU removed
(its replicas are gone from the carried placement and are re-placed on free slots).
Each copied replica is one expert's weights, so the plan is priced by
``bytes_moved = copies x expert_bytes``.

Shape: ``steps[i]`` is one pair's migrations in order (a pair runs one migration at a time);
a step's ``source`` is a replica of the pair when the step starts.

Example: ``plan_change(table, loads, ("g0", "g1", "g2"), top_k=2, expert_bytes=3 << 20)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from expertmesh.contracts.errors import GroupChangeRefused
from expertmesh.contracts.gpu_plan import Placement
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.contracts.topology import Gpu, Island, Node, Topology
from expertmesh.orchestrator.drift.rebalance import LayerLoads
from expertmesh.orchestrator.drift.state import ExpertLoad
from expertmesh.orchestrator.migration.state import MigrationMode
from expertmesh.orchestrator.placement.incremental import replan
from expertmesh.orchestrator.placement.planner import PlanOptions
from expertmesh.orchestrator.placement.stats import LoadStats

__all__ = ["GroupPlan", "Step", "fits", "plan_change", "size", "steps_for"]

#: a layer the repair leaves within this balancedness of the full plan's is kept: fewer weights copied
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Step:
    """One migration of the plan."""

    layer: int
    expert: int
    mode: MigrationMode
    source: str
    target: str | None = None


@dataclass(frozen=True)
class GroupPlan:
    #: per pair, its migrations in order (pairs in (layer, expert) order)
    steps: tuple[tuple[Step, ...], ...]
    #: replicas copied onto a group that did not hold them
    copies: int
    bytes_moved: int
    #: (layer, expert) -> groups after the plan
    after: Mapping[tuple[int, int], tuple[str, ...]]

    @property
    def moves(self) -> int:
        return sum(len(s) for s in self.steps)


def steps_for(pair: tuple[int, int], before: Sequence[str], after: Sequence[str]) -> tuple[Step, ...]:
    """The migrations that take ``pair`` from replicas ``before`` to ``after`` without ever leaving it
    unserved: a replica that goes and one that comes pair up as a move, another that comes is a replicate
    (from a replica that stays), another that goes is an evict, last."""
    layer, expert = pair
    gone = [g for g in before if g not in after]
    new = [g for g in after if g not in before]
    stays = [g for g in before if g in after]
    steps = [Step(layer, expert, MigrationMode.MOVE, s, t) for s, t in zip(gone, new)]
    for target in new[len(gone) :]:
        steps.append(Step(layer, expert, MigrationMode.REPLICATE, (stays or new[: len(gone)])[0], target))
    steps.extend(Step(layer, expert, MigrationMode.EVICT, s) for s in gone[len(new) :])
    return tuple(steps)


def plan_change(
    table: RoutingTable,
    loads: Iterable[ExpertLoad],
    groups_after: Sequence[str],
    top_k: int,
    expert_bytes: int,
    min_gain: float = MIN_GAIN,
) -> GroupPlan:
    """The moves that take ``table``'s placement onto ``groups_after`` (a group more: it is filled; one fewer:
    it is drained), as balanced by ``loads`` as the incremental planner makes it with the fewest copies
    (``min_gain``: a repaired layer this close to the full plan's balancedness is not re-planned)."""
    if not groups_after:
        raise GroupChangeRefused("no expert group would be left; every expert needs one")
    frame = LayerLoads.build(table, loads, groups_after)
    column = {name: g for g, name in enumerate(frame.groups)}
    E = table.num_experts
    per_layer = (frame.shares > 0).sum(axis=(1, 2))  # [L] replicas per layer now
    redundant = int(max(0, per_layer.max(initial=E) - E))
    redundant = min(redundant, E * (len(groups_after) - 1))
    after_ids = tuple(column[name] for name in groups_after)
    island = Island("groups", tuple(Gpu(g, 0.0) for g in after_ids))
    stats = LoadStats(len(frame.layers), E, min(max(top_k, 1), E), frame.load)
    previous = Placement(tuple(range(len(frame.groups))), frame.shares)
    result = replan(
        stats, Topology((Node("groups", (island,)),)), PlanOptions(redundant=redundant, min_gain=min_gain), previous
    )
    planned = result.placement.shares.copy()  # [L, E, G_after]
    names = [frame.groups[g] for g in result.placement.gpu_ids]
    for name in (n for n in groups_after if n not in table.groups()):
        _fill_evenly(planned, frame.load, names.index(name), (E + redundant) // len(groups_after))
    steps, after, copies = [], {}, 0
    for r, layer in enumerate(frame.layers):
        for expert in range(E):
            pair = (layer, expert)
            before = table.replicas.get(pair, ())
            then = tuple(names[g] for g in np.flatnonzero(planned[r, expert] > 0))
            after[pair] = then
            copies += sum(1 for g in then if g not in before)
            pair_steps = steps_for(pair, before, then)
            if pair_steps:
                steps.append(pair_steps)
    return GroupPlan(tuple(steps), copies, copies * expert_bytes, after)


def _fill_evenly(shares: np.ndarray, load: np.ndarray, g: int, want: int) -> None:
    """shares [L, E, G] (in place), load [L, E]: in each layer where group ``g`` holds fewer than ``want``
    replicas, the group with the most gives it its least loaded expert that ``g`` lacks, until it has
    ``want``. The planner keeps an idle layer as it is (nothing to balance); an added group still gets
    its even share of the experts."""
    for r in range(shares.shape[0]):
        has = shares[r] > 0  # [E, G]
        while has[:, g].sum() < want:
            counts = has.sum(axis=0)
            counts[g] = -1
            donor = int(np.argmax(counts))
            movable = np.flatnonzero(has[:, donor] & ~has[:, g])
            if movable.size == 0:
                break
            e = int(movable[np.argmin(load[r, movable])])
            shares[r, e, g], shares[r, e, donor] = shares[r, e, donor], 0.0
            has = shares[r] > 0


def fits(plan: GroupPlan, free_bytes: Mapping[str, int | None], expert_bytes: int) -> str | None:
    """Why ``plan`` does not fit the groups' free memory (``free_bytes``: budget less what each holds; None =
    unlimited), naming the first group it overfills; None when it fits. Counts only what each group gains."""
    gained: dict[str, int] = {}
    for pair_steps in plan.steps:
        for step in pair_steps:
            if step.target is not None:
                gained[step.target] = gained.get(step.target, 0) + expert_bytes
            if step.mode is MigrationMode.MOVE:
                gained[step.source] = gained.get(step.source, 0) - expert_bytes
    for group in sorted(gained):
        free = free_bytes.get(group)
        if free is not None and gained[group] > free:
            return (
                f"group {group} would need {size(gained[group])} more for expert weights and has "
                f"{size(max(free, 0))} free in its budget"
            )
    return None


def size(n: int) -> str:
    """Bytes for a person: ``size(3 << 20)`` is "3.0 MiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
