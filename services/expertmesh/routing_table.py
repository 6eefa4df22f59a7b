"""The versioned routing table: (layer, expert) -> the groups that hold it.

Glossary
- *group*: one expert-group service (a Ray Serve deployment), named like ``g0``.
- *replica* of a logical expert: one group holding it; hot experts may have several.
- *share*: the fraction of a logical expert's tokens a replica takes (equal
  unless the placement planner says otherwise).
- *version*: increases by one with every edit. Routers cache a table and switch
  to a newer version only between forward passes (a step boundary), so one step
  never mixes two placements.

Pure data: no I/O. The state store persists it as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from expertmesh.placement import GroupPlacement


@dataclass(frozen=True)
class RoutingTable:
    version: int
    num_experts: int
    #: (layer, expert) -> group names holding it, preferred first
    replicas: dict[tuple[int, int], tuple[str, ...]]
    #: (layer, expert) -> share of its tokens each replica above takes; absent = equal shares
    shares: dict[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def from_placement(
        cls,
        placement: GroupPlacement,
        num_experts: int,
        version: int = 1,
        shares: dict[tuple[int, int], dict[str, float]] | None = None,
    ) -> "RoutingTable":
        replicas = placement.hosts()
        by_pair = {
            pair: tuple(shares[pair][g] for g in groups)
            for pair, groups in replicas.items()
            if shares and pair in shares and len(groups) > 1
        }
        return cls(version=version, num_experts=num_experts, replicas=replicas, shares=by_pair)

    def shares_of(self, pair: tuple[int, int]) -> tuple[float, ...]:
        groups = self.replicas[pair]
        return self.shares.get(pair) or tuple(1.0 / len(groups) for _ in groups)

    def placement(self) -> GroupPlacement:
        """Which pairs each group holds, as a placement."""
        groups: dict[str, list[tuple[int, int]]] = {}
        for pair, names in sorted(self.replicas.items()):
            for name in names:
                groups.setdefault(name, []).append(pair)
        return GroupPlacement({name: tuple(pairs) for name, pairs in sorted(groups.items())})

    def groups(self) -> list[str]:
        return sorted({g for names in self.replicas.values() for g in names})

    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.replicas})

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "num_experts": self.num_experts,
                "replicas": [[layer, e, list(g)] for (layer, e), g in sorted(self.replicas.items())],
                "shares": [[layer, e, list(s)] for (layer, e), s in sorted(self.shares.items())],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "RoutingTable":
        data = json.loads(text)
        return cls(
            version=int(data["version"]),
            num_experts=int(data["num_experts"]),
            replicas={(int(layer), int(e)): tuple(g) for layer, e, g in data["replicas"]},
            shares={(int(layer), int(e)): tuple(float(x) for x in s) for layer, e, s in data.get("shares", [])},
        )
