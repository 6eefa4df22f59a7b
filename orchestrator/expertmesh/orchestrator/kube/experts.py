"""``kubectl expertmesh experts`` as pure functions: the routing table and the routers'
load -> one row per (layer, expert), and those rows as a table or JSON.

Load share is the fraction of a layer's routed token-slots (a token counts once
per expert its top-k chose) that went to the expert, summed over every router's
window; a replica's share is the fraction of the expert's tokens that replica
takes (equal unless the placement planner set shares). A replica the health monitor
keeps out of service while the table still lists it (the expert's last one: routers
fall back for it) is marked with its state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from expertmesh.contracts.routing_table import RoutingTable

#: MoE layer index -> tokens that chose each expert ([E] counts)
LayerLoad = dict[int, tuple[float, ...]]

_COLUMNS = ("LAYER", "EXPERT", "GROUPS", "LOAD")


@dataclass(frozen=True)
class Replica:
    group: str
    share: float
    #: "quarantined" or "probation" when the health monitor keeps it out of service (the state store's
    #: ``quarantine`` hash): listed, yet routers send it no tokens; "" in service
    state: str = ""


@dataclass(frozen=True)
class ExpertRow:
    layer: int
    expert: int
    #: preferred first, as the routing table lists them
    replicas: tuple[Replica, ...]
    #: None when no router has published load for the layer
    load_share: float | None


def expert_rows(
    table: RoutingTable,
    load: LayerLoad,
    layer: int | None = None,
    out_of_service: Mapping[tuple[int, int, str], str] | None = None,
) -> list[ExpertRow]:
    """``out_of_service``: (layer, expert, group) -> "quarantined" or "probation"."""
    rows, out_of_service = [], out_of_service or {}
    for pair in sorted(table.replicas):
        if layer is not None and pair[0] != layer:
            continue
        replicas = tuple(
            Replica(g, s, out_of_service.get((*pair, g), ""))
            for g, s in zip(table.replicas[pair], table.shares_of(pair))
        )
        counts = load.get(pair[0])
        total = sum(counts) if counts else 0.0
        share = counts[pair[1]] / total if counts and total > 0 and pair[1] < len(counts) else None
        rows.append(ExpertRow(pair[0], pair[1], replicas, share))
    return rows


def render_table(table: RoutingTable, rows: list[ExpertRow], routers: int) -> str:
    load_from = f"load from {routers} router{'s' if routers != 1 else ''}" if routers else "no load published yet"
    header = (
        f"routing table v{table.version}: {len(table.layers())} MoE layers, {len(table.groups())} groups; {load_from}"
    )
    cells = [
        (
            str(r.layer),
            str(r.expert),
            ", ".join(
                (f"{p.group} ({p.share:.0%})" if len(r.replicas) > 1 else p.group)
                + (f" [{p.state}]" if p.state else "")
                for p in r.replicas
            ),
            f"{r.load_share:.1%}" if r.load_share is not None else "-",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [_COLUMNS, *cells]) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [_COLUMNS, *cells]]
    return "\n".join([header, *lines])


def render_json(table: RoutingTable, rows: list[ExpertRow], routers: int) -> str:
    return json.dumps(
        {"routing_table_version": table.version, "routers": routers, "experts": [asdict(r) for r in rows]}, indent=2
    )
