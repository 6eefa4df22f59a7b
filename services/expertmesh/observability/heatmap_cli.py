"""``expertmesh heatmap``: expert x token-position activation frequency per MoE layer, as a PNG.

From the router's recorded routing (``GetLoadStats``' ``position_load``): its
whole load window by default, or only the load added by ``--requests N``
generations the command sends first. ``--by domain`` (expert x query domain)
needs the query classifier, a later feature, and is refused for now.
"""

from __future__ import annotations

import sys
from pathlib import Path

from expertmesh.errors import InvalidRequest
from expertmesh.observability.probe_cli import add_traffic_arguments, check_traffic_arguments, collect


def add_command(commands) -> None:
    parser = commands.add_parser("heatmap", help="render expert x token-position activation per layer to a PNG")
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--by", choices=("position", "domain"), default="position", help="x axis (default position)")
    add_traffic_arguments(parser, requests_default=0)
    parser.add_argument("--dpi", type=int, default=100)
    parser.set_defaults(run=_main)


def _main(args) -> int:
    if args.by == "domain":
        raise InvalidRequest(
            "--by domain needs the query classifier, which is not available yet (a later feature); use --by position"
        )
    if args.out.suffix.lower() != ".png":
        raise InvalidRequest(f"--out {args.out}: the heatmap is written as PNG, name the file *.png")
    if not args.out.parent.is_dir():
        raise InvalidRequest(f"--out {args.out}: folder {args.out.parent} does not exist")
    prompts = check_traffic_arguments(args)
    from expertmesh.observability import remote
    from expertmesh.observability.heatmap import render_position_heatmap

    with remote.Router(args.target, timeout=args.timeout) as router:
        info = router.model()
        stats, traffic, source = collect(router, info, args, prompts)
    remote.check_not_empty(stats, args.target, source)
    if stats.position_load.size == 0 or stats.position_load.sum() <= 0:
        raise InvalidRequest(f"{source} of {args.target} has no token positions recorded (only the serving engine records them)")
    png = render_position_heatmap(
        stats.position_load, stats.moe_layers, stats.max_context or info.max_context, stats.top_k, info.name, dpi=args.dpi
    )
    args.out.write_bytes(png)
    tokens = stats.position_load[0].sum() / max(stats.top_k, 1)
    print(
        f"wrote {args.out} ({len(png) // 1024} KiB): {len(stats.moe_layers)} MoE layers x {stats.num_experts} experts "
        f"by position, {tokens:,.0f} tokens from {source}",
        file=sys.stderr,
    )
    return 0
