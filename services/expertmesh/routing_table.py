"""The versioned routing table: (layer, expert) -> the groups that hold it.

Glossary
- *group*: one expert-group service (a Ray Serve deployment), named like ``g0``.
- *replica* of a logical expert: one group holding it; hot experts may have several.
- *version*: increases by one with every edit. Routers cache a table and switch
  to a newer version only between forward passes (a step boundary), so one step
  never mixes two placements.

Pure data: no I/O. The state store persists it as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from expertmesh.placement import GroupPlacement


@dataclass(frozen=True)
class RoutingTable:
    version: int
    num_experts: int
    #: (layer, expert) -> group names holding it, preferred first
    replicas: dict[tuple[int, int], tuple[str, ...]]

    @classmethod
    def from_placement(cls, placement: GroupPlacement, num_experts: int, version: int = 1) -> "RoutingTable":
        return cls(version=version, num_experts=num_experts, replicas=placement.hosts())

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
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "RoutingTable":
        data = json.loads(text)
        return cls(
            version=int(data["version"]),
            num_experts=int(data["num_experts"]),
            replicas={(int(layer), int(e)): tuple(g) for layer, e, g in data["replicas"]},
        )
