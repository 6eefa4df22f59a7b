"""``expertmesh drift --once [--dry-run]``: ask the orchestrator's drift controller
for one scan now and print what it saw and decided.

The loop itself runs inside the orchestrator (``--drift``); this command is the
same scan on demand, through the admin API. Exit codes as everywhere: 0 done, 2
bad input or an unreachable orchestrator (one line).
"""

from __future__ import annotations

from expertmesh.orchestrator.admin_client import DEFAULT_ADMIN, call, connect
from expertmesh.v1 import admin_pb2 as pb


def add_command(commands) -> None:
    p = commands.add_parser("drift", help="run one drift scan in the orchestrator now and print its decisions")
    p.add_argument(
        "--once", action="store_true", required=True, help="scan once now (the loop runs in the orchestrator: --drift)"
    )
    p.add_argument("--dry-run", action="store_true", help="decide and print, but move nothing and change no counter")
    p.add_argument("--admin", default=DEFAULT_ADMIN, help=f"orchestrator admin address (default {DEFAULT_ADMIN})")
    p.set_defaults(run=run)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def _percent(message, field: str) -> str:
    return f"{getattr(message, field):.1%}" if message.HasField(field) else "-"


def render(response: pb.ScanDriftResponse) -> str:
    groups = _table(
        ("GROUP", "MEMORY", "BUSY", "WEIGHT BYTES", "BUDGET BYTES", "SCANS ABOVE"),
        [
            (
                g.group,
                _percent(g, "memory"),
                _percent(g, "busy"),
                str(g.weight_bytes),
                str(g.budget_bytes or "-"),
                str(g.scans_above),
            )
            for g in response.groups
        ],
    )
    layers = _table(
        ("LAYER", "BALANCEDNESS", "SCANS BELOW"),
        [(str(b.layer), f"{b.balancedness:.3f}", str(b.scans_below)) for b in response.layers],
    )
    lines = [groups, "", layers, "", f"load windows: {response.window_tokens:.0f} tokens", ""]
    if not response.decisions:
        lines.append("no decisions: nothing stayed past a watermark or threshold long enough")
    for d in response.decisions:
        move = f" layer {d.layer} expert {d.expert} {d.source} -> {d.target}" if d.source else ""
        started = f" (migration {d.migration_id})" if d.migration_id else ""
        held = f" ({d.hold})" if d.hold else ""
        lines.append(f"{d.result}{held} {d.trigger}{move}{started}: {d.detail}")
    return "\n".join(lines)


def run(args) -> int:
    channel, stub = connect(args.admin)
    with channel:
        response = call(stub.ScanDrift, pb.ScanDriftRequest(dry_run=args.dry_run))
    print(("dry run: nothing moves\n" if response.dry_run else "") + render(response), flush=True)
    return 0
