"""The rebalance trigger's arithmetic: each MoE layer's balancedness over the
expert groups, and the placement planner's moves for a layer, as ``expertmesh plan
--current`` would make them. Pure: arrays from plain data, no I/O.

The planner places replicas on GPUs of a topology; here every expert group is one
"GPU" of a single NVLink island (drift knows no topology, and with one island the
planner optimises balance alone). It plans one replica per expert
(``redundant=0``) with its default slots per group, ``ceil(E / groups)``, so a
layer also ends with its experts spread evenly over the groups. Replicas are not
drift's business: an expert with several replicas stays as it is, and only
experts with one move. ``planned_placement`` plans every layer at once, replicas included
(``--redundant``), for a caller that carries it out itself (``bench serve --redundant``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from expertmesh.contracts.gpu_plan import Placement
from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.contracts.topology import Gpu, Island, Node, Topology
from expertmesh.orchestrator.drift.state import ExpertLoad, Move
from expertmesh.orchestrator.placement.planner import PlanOptions, plan
from expertmesh.orchestrator.placement.quality import layer_balancedness
from expertmesh.orchestrator.placement.stats import LoadStats


@dataclass(frozen=True, eq=False)
class LayerLoads:
    """The routing table and the load windows as the planner's arrays."""

    #: MoE layer of each row
    layers: tuple[int, ...]
    #: group of each column
    groups: tuple[str, ...]
    load: np.ndarray  # [L, E] float64 tokens per expert
    shares: np.ndarray  # [L, E, G] float64 share of each expert's tokens each group takes (routing table)

    @classmethod
    def build(cls, table: RoutingTable, loads: Iterable[ExpertLoad], groups: Iterable[str]) -> LayerLoads:
        """``groups``: the columns, every group the table lists added (sorted)."""
        layers = tuple(table.layers())
        names = tuple(sorted(set(groups) | set(table.groups())))
        row = {layer: i for i, layer in enumerate(layers)}
        column = {name: g for g, name in enumerate(names)}
        load = np.zeros((len(layers), table.num_experts))
        for entry in loads:
            if entry.layer in row and 0 <= entry.expert < table.num_experts:
                load[row[entry.layer], entry.expert] = entry.tokens
        shares = np.zeros((len(layers), table.num_experts, len(names)))
        for (layer, expert), replicas in table.replicas.items():
            for name, share in zip(replicas, table.shares_of((layer, expert))):
                shares[row[layer], expert, column[name]] = share
        return cls(layers, names, load, shares)

    def balancedness(self) -> dict[int, float]:
        """Layer -> mean / max of the groups' token loads (1.0 for an idle layer)."""
        return dict(zip(self.layers, layer_balancedness(self.load, self.shares).tolist()))

    def planned_moves(self, layer: int, top_k: int, min_gain: float) -> list[Move] | None:
        """The planner's moves for ``layer`` given where its experts are now, heaviest expert
        first; None when it keeps the layer (its balancedness within ``min_gain`` of the plan's)."""
        r = self.layers.index(layer)
        result = self._plan(slice(r, r + 1), top_k, PlanOptions(redundant=0, min_gain=min_gain))
        if result.layers_kept:
            return None
        planned = result.placement.shares[0]  # [E, G]
        moves = []
        for expert in np.argsort(-self.load[r], kind="stable"):
            now, then = np.flatnonzero(self.shares[r, expert] > 0), np.flatnonzero(planned[expert] > 0)
            if len(now) == 1 and len(then) == 1 and now[0] != then[0]:
                moves.append(Move(layer, int(expert), self.groups[now[0]], self.groups[then[0]]))
        return moves

    def planned_placement(self, top_k: int, redundant: int) -> GroupPlacement:
        """Every layer as the planner places it over these groups with ``redundant`` more replicas per layer
        (``expertmesh plan --redundant`` with the groups as the GPUs of one island), keeping each expert where
        it is when that is as balanced."""
        planned = self._plan(slice(None), top_k, PlanOptions(redundant=redundant)).placement.shares  # [L, E, G]
        return GroupPlacement(
            {
                group: tuple(
                    (layer, int(e)) for r, layer in enumerate(self.layers) for e in np.flatnonzero(planned[r, :, g] > 0)
                )
                for g, group in enumerate(self.groups)
            }
        )

    def _plan(self, rows: slice, top_k: int, options: PlanOptions):
        """The planner over ``rows`` of the layers, the groups as the GPUs of one island, from where they are now."""
        num_groups, num_experts = len(self.groups), self.load.shape[1]
        load = self.load[rows]
        island = Island("groups", tuple(Gpu(g, 0.0) for g in range(num_groups)))
        stats = LoadStats(load.shape[0], num_experts, min(max(top_k, 1), num_experts), load)
        current = Placement(tuple(range(num_groups)), self.shares[rows])
        return plan(stats, Topology((Node("groups", (island,)),)), options, current)
