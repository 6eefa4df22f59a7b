"""The versioned routing table: (layer, expert) -> the groups that hold it.

Glossary
- *group*: one expert-group service (a Ray Serve deployment), named like ``g0``.
- *replica* of a logical expert: one group holding it; hot experts may have several.
- *share*: the fraction of a logical expert's tokens a replica takes (equal
  unless the placement planner says otherwise).
- *version*: increases by one with every edit. Routers cache a table and switch
  to a newer version only between forward passes (a step boundary), so one step
  never mixes two placements.
- *model identity* (``ModelIdentity``): which model a table was made for, its
  checkpoint's fingerprint, MoE layers and experts per layer. A router serves
  only a table made for its own model (``router.routing_view``): a table of
  another model would route tokens to the wrong experts with status OK.

Pure data: no I/O. The state store persists it as JSON; ``from_json`` raises
``MalformedTable`` for text that is not a routing table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from expertmesh.contracts.group_map import GroupPlacement


class MalformedTable(ValueError):
    """Stored text that does not parse as a routing table."""


@dataclass(frozen=True)
class ModelIdentity:
    """The model a routing table is for. Example: ``ModelIdentity("3f2a9c0d1e4b5a67", (1, 2, 3), 256)``."""

    #: ``Checkpoint``'s fingerprint of its config and weight files ("" where unknown: then only the shape is checked)
    fingerprint: str
    moe_layers: tuple[int, ...]
    num_experts: int

    @classmethod
    def of(cls, spec) -> "ModelIdentity":
        """The identity of a checkpoint's ``MoESpec``."""
        return cls(spec.fingerprint, tuple(spec.moe_layers), spec.num_experts)

    def differences(self, other: "ModelIdentity") -> list[str]:
        """What differs from ``other``, one phrase each ("" fingerprints match anything)."""
        out = []
        if self.fingerprint and other.fingerprint and self.fingerprint != other.fingerprint:
            out.append(f"checkpoint fingerprint {other.fingerprint}, not {self.fingerprint}")
        if self.moe_layers != other.moe_layers:
            out.append(f"MoE layers {_span(other.moe_layers)}, not {_span(self.moe_layers)}")
        if self.num_experts != other.num_experts:
            out.append(f"{other.num_experts} experts per layer, not {self.num_experts}")
        return out


def _span(layers: tuple[int, ...]) -> str:
    if len(layers) > 2 and layers == tuple(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers)) or "none"


@dataclass(frozen=True)
class RoutingTable:
    version: int
    num_experts: int
    #: (layer, expert) -> group names holding it, preferred first
    replicas: dict[tuple[int, int], tuple[str, ...]]
    #: (layer, expert) -> share of its tokens each replica above takes; absent = equal shares
    shares: dict[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)
    #: the model it was made for (None: a table written before tables carried it)
    model: ModelIdentity | None = None

    @classmethod
    def from_placement(
        cls,
        placement: GroupPlacement,
        num_experts: int,
        version: int = 1,
        shares: dict[tuple[int, int], dict[str, float]] | None = None,
        model: ModelIdentity | None = None,
    ) -> "RoutingTable":
        replicas = placement.hosts()
        by_pair = {
            pair: tuple(shares[pair][g] for g in groups)
            for pair, groups in replicas.items()
            if shares and pair in shares and len(groups) > 1
        }
        return cls(version=version, num_experts=num_experts, replicas=replicas, shares=by_pair, model=model)

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

    def misfits(self, moe_layers: tuple[int, ...], model: ModelIdentity | None = None) -> list[str]:
        """Why this table cannot route the tokens of ``model`` (None: a model of ``moe_layers`` whose expert
        count is the table's own), each a phrase after "routing table version N"; [] when it fits.

        A table of another model, or with pairs the model does not have, would send tokens to the wrong
        experts with status OK: routers refuse it (``router.dispatch.routing_view``) and a starting group
        does not load from it (``expert_group.runtime.start_pairs``)."""
        out = []
        if model is not None:
            # what the table claims, with the expert count dispatch uses (a table without an identity: its shape only)
            claimed = (
                replace(self.model, num_experts=self.num_experts)
                if self.model is not None
                else ModelIdentity("", model.moe_layers, self.num_experts)
            )
            problems = model.differences(claimed)
            if problems:
                out.append(f"is for another model: {'; '.join(problems)}")
        layers = set(moe_layers)
        stray = [(layer, e) for layer, e in self.replicas if layer not in layers or not 0 <= e < self.num_experts]
        if stray:
            shown = ", ".join(f"{layer}/{e}" for layer, e in sorted(stray)[:8])
            out.append(
                f"lists {len(stray)} layer/expert pairs this model does not have ({len(layers)} MoE layers, "
                f"{self.num_experts} experts each): {shown}"
            )
        uneven = [pair for pair, shares in self.shares.items() if len(shares) != len(self.replicas.get(pair, ()))]
        if uneven:
            out.append(f"gives {len(uneven)} experts a share per replica that does not match their replicas")
        return out

    def groups(self) -> list[str]:
        return sorted({g for names in self.replicas.values() for g in names})

    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.replicas})

    def to_json(self) -> str:
        data = {
            "version": self.version,
            "num_experts": self.num_experts,
            "replicas": [[layer, e, list(g)] for (layer, e), g in sorted(self.replicas.items())],
            "shares": [[layer, e, list(s)] for (layer, e), s in sorted(self.shares.items())],
        }
        if self.model is not None:
            data["model"] = {
                "fingerprint": self.model.fingerprint,
                "moe_layers": list(self.model.moe_layers),
                "num_experts": self.model.num_experts,
            }
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> "RoutingTable":
        try:
            data = json.loads(text)
            model = data.get("model")
            return cls(
                version=int(data["version"]),
                num_experts=int(data["num_experts"]),
                replicas={(int(layer), int(e)): tuple(str(n) for n in g) for layer, e, g in data["replicas"]},
                shares={(int(layer), int(e)): tuple(float(x) for x in s) for layer, e, s in data.get("shares", [])},
                model=None
                if model is None
                else ModelIdentity(
                    str(model["fingerprint"]), tuple(map(int, model["moe_layers"])), int(model["num_experts"])
                ),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise MalformedTable(f"not a routing table ({type(err).__name__}: {str(err)[:200]})") from None
