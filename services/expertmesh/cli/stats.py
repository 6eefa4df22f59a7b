"""``expertmesh stats export``: the routers' expert load, as the stats file of ``expertmesh plan``.

From one router over gRPC (``--target``, the embedded default) or from every
router that publishes to a shared state store (``--state-url``), summed: each router's window as of its last
detail (``contracts.load_report``), at most ``DETAIL_EVERY`` load publishes old.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import grpc

from expertmesh.contracts.errors import GroupUnavailable


def add_command(commands) -> None:
    stats = commands.add_parser("stats", help="expert load statistics recorded by the routers")
    sub = stats.add_subparsers(dest="stats_command", required=True, metavar="ACTION")
    export = sub.add_parser("export", help="write the load stats file that `expertmesh plan --stats` reads")
    source = export.add_mutually_exclusive_group()
    source.add_argument("--target", default="127.0.0.1:50051", help="a router's gRPC address (default)")
    source.add_argument("--state-url", help="sum all routers publishing to this store (redis://...)")
    export.add_argument(
        "--out",
        type=Path,
        default=Path("stats.json"),
        help="stats JSON to write (the input of `expertmesh plan --stats`)",
    )
    export.set_defaults(run=_export)


def _export(args) -> int:
    if args.state_url:
        from expertmesh.contracts.load_report import summed_details
        from expertmesh.store import open_store

        store = open_store(args.state_url)
        published, pulses = store.load_details(), store.loads()
        store.close()
        total = summed_details(published, pulses, now=time.time())  # without routers gone for two windows
        if total is None:
            raise GroupUnavailable(f"no router has published load statistics to {args.state_url} yet")
        stats = total.to_stats_dict()
        source = f"{len(published)} routers"
    else:
        from expertmesh.client import Client

        with Client(args.target, timeout=30) as client:
            try:
                stats = json.loads(client.load_stats())
            except grpc.RpcError as err:
                raise GroupUnavailable(
                    f"cannot read load stats from {args.target}: {err.code().name}: {err.details()}"
                ) from None
        source = args.target
    args.out.write_text(json.dumps(stats))
    tokens = sum(stats["load"][0]) / max(stats["top_k"], 1) if stats["load"] else 0
    print(
        f"wrote {args.out}: {stats['num_layers']} MoE layers x {stats['num_experts']} experts, "
        f"~{tokens:.0f} tokens in the window, from {source}",
        file=sys.stderr,
    )
    return 0
