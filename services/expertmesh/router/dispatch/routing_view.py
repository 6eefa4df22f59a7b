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
answer with status OK. So is a table made for another model, or one naming
layers or experts the model does not have (``RoutingTableMismatch``): a table
for 4 experts over an 8-expert model would drop experts 4-7 just as silently.
The router then keeps serving its last good view.

Quarantined replicas (the health monitor's, in the state store) are left out of
the view. An expert whose every listed replica is quarantined is a *fallback*
expert: no group gets its tokens (its primary is -1), and the router routes
around it (``router.gate_hook``: the gate picks the next-best expert instead, or
the token's other experts are renormalised).

- *routing epoch*: a counter the router's table watcher moves on whenever the
  quarantined replicas it serves around change (a quarantine, a repair, a
  release): what some expert computes for a token may differ from then on, so the
  serving engine's prefix cache never reuses keys and values computed in another
  epoch (``serving.kv_blocks.PrefixScope``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from expertmesh.contracts.errors import RoutingTableMismatch, UnhostedExperts
from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable


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
    #: layer -> experts whose every replica is quarantined (their tokens go nowhere)
    fallback: dict[int, frozenset[int]]
    #: the quarantined (layer, expert, group) replicas this view leaves out
    quarantined: frozenset[tuple[int, int, str]] = frozenset()
    #: the routing epoch it was built in (see the glossary)
    epoch: int = 0

    @classmethod
    def build(
        cls,
        table: RoutingTable,
        moe_layers: Sequence[int],
        quarantined: frozenset[tuple[int, int, str]] = frozenset(),
        model: ModelIdentity | None = None,
        epoch: int = 0,
    ) -> "RoutingView":
        """Raises RoutingTableMismatch when ``table`` is not for ``model`` (None: a model of ``moe_layers``
        whose expert count is the table's own) and UnhostedExperts when it misses a pair of ``moe_layers`` x
        experts."""
        _check_fits(table, tuple(moe_layers), model)
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
        fallback: dict[int, set[int]] = {}
        for (layer, expert), names in sorted(table.replicas.items()):
            row = primary.setdefault(layer, torch.full((table.num_experts,), -1, dtype=torch.long))
            shares = table.shares_of((layer, expert))
            kept = [(index[g], s) for g, s in zip(names, shares) if (layer, expert, g) not in quarantined]
            ids = tuple(g for g, _ in kept)
            holders[(layer, expert)] = ids
            if not ids:
                fallback.setdefault(layer, set()).add(expert)
                continue
            row[expert] = ids[0]
            if len(ids) > 1:
                replicated.setdefault(layer, []).append(Replicated(expert, ids, tuple(s for _, s in kept)))
        return cls(
            table=table,
            groups=groups,
            primary=primary,
            replicated={layer: tuple(r) for layer, r in replicated.items()},
            holders=holders,
            fallback={layer: frozenset(e) for layer, e in fallback.items()},
            quarantined=frozenset(q for q in quarantined if q[:2] in table.replicas),
            epoch=epoch,
        )

    @property
    def version(self) -> int:
        return self.table.version

    @property
    def num_experts(self) -> int:
        return self.table.num_experts


def _check_fits(table: RoutingTable, moe_layers: tuple[int, ...], model: ModelIdentity | None) -> None:
    """Raise RoutingTableMismatch unless every entry of ``table`` names a layer and expert of the model."""
    misfits = table.misfits(moe_layers, model)
    if misfits:
        raise RoutingTableMismatch(f"routing table version {table.version} {'; it '.join(misfits)}")
