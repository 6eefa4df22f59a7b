"""The router's immutable view of one routing-table version, as tensors.

Built once when the router switches tables (``RoutingView.build``) and swapped
in with one assignment, so a dispatch that read the view keeps a consistent
placement however the table changes under it.

Glossary
- *group index*: position of a group name in ``RoutingView.groups`` (sorted); the
  plan and the transport's per-group counters use it.
- *primary*: the first replica the table lists for an expert; an expert with one
  replica always goes there.

A table that leaves any (MoE layer, expert) of the model without a replica is
refused (``UnhostedExperts``): its tokens would be dropped silently, a wrong
answer with status OK. The router then keeps serving its last good view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from expertmesh.errors import UnhostedExperts
from expertmesh.routing_table import RoutingTable


@dataclass(frozen=True)
class Replicated:
    """One expert held by several groups, and how its tokens are split across them."""

    expert: int
    groups: tuple[int, ...]  # group indices, preferred first
    shares: tuple[float, ...]


@dataclass(frozen=True)
class RoutingView:
    table: RoutingTable
    groups: tuple[str, ...]
    #: layer -> [num_experts] int64 group index of each expert's primary replica
    primary: dict[int, torch.Tensor]
    #: layer -> experts held by more than one group
    replicated: dict[int, tuple[Replicated, ...]]
    #: (layer, expert) -> every group index holding it
    holders: dict[tuple[int, int], tuple[int, ...]]

    @classmethod
    def build(cls, table: RoutingTable, moe_layers: Sequence[int]) -> "RoutingView":
        """Raises UnhostedExperts when ``table`` misses a pair of ``moe_layers`` x experts."""
        missing = [
            (layer, e) for layer in moe_layers for e in range(table.num_experts) if not table.replicas.get((layer, e))
        ]
        if missing:
            shown = ", ".join(f"{layer}/{e}" for layer, e in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise UnhostedExperts(
                f"routing table version {table.version} leaves {len(missing)} experts (layer/expert) without a "
                f"group: {shown}{more}"
            )
        groups = tuple(table.groups())
        index = {g: i for i, g in enumerate(groups)}
        primary: dict[int, torch.Tensor] = {}
        replicated: dict[int, list[Replicated]] = {}
        holders: dict[tuple[int, int], tuple[int, ...]] = {}
        for (layer, expert), names in sorted(table.replicas.items()):
            row = primary.setdefault(layer, torch.full((table.num_experts,), -1, dtype=torch.long))
            ids = tuple(index[g] for g in names)
            row[expert] = ids[0]
            holders[(layer, expert)] = ids
            if len(ids) > 1:
                replicated.setdefault(layer, []).append(Replicated(expert, ids, table.shares_of((layer, expert))))
        return cls(
            table=table,
            groups=groups,
            primary=primary,
            replicated={layer: tuple(r) for layer, r in replicated.items()},
            holders=holders,
        )

    @property
    def version(self) -> int:
        return self.table.version

    @property
    def num_experts(self) -> int:
        return self.table.num_experts
