"""``expertmesh heatmap``: expert x token-position activation frequency per MoE layer, as a PNG.

From the router's recorded routing (``GetLoadStats``' ``position_load``): its
whole load window by default, or only the load added by ``--requests N``
generations the command sends first. ``--by domain``: expert x query domain
from the router's counts by domain (requests that named or were classified into
one, since the router started; ``expertmesh profile build`` sends labelled ones).
"""

from __future__ import annotations

import sys
from pathlib import Path

from expertmesh.cli.probe import add_traffic_arguments, check_traffic_arguments, collect
from expertmesh.contracts.errors import InvalidRequest


def add_command(commands) -> None:
    parser = commands.add_parser("heatmap", help="render expert x token-position activation per layer to a PNG")
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--by", choices=("position", "domain"), default="position", help="x axis (default position)")
    add_traffic_arguments(parser, requests_default=0)
    parser.add_argument("--dpi", type=int, default=100, help="resolution of the PNG")
    parser.set_defaults(run=_main)


def _main(args) -> int:
    if args.out.suffix.lower() != ".png":
        raise InvalidRequest(f"--out {args.out}: the heatmap is written as PNG, name the file *.png")
    if not args.out.parent.is_dir():
        raise InvalidRequest(f"--out {args.out}: folder {args.out.parent} does not exist")
    if args.by == "domain":
        return _by_domain(args)
    prompts = check_traffic_arguments(args)
    from expertmesh.observability import remote
    from expertmesh.observability.heatmap import render_position_heatmap

    with remote.Router(args.target, timeout=args.timeout) as router:
        info = router.model()
        stats, traffic, source = collect(router, info, args, prompts)
    remote.check_not_empty(stats, args.target, source)
    if stats.position_load.size == 0 or stats.position_load.sum() <= 0:
        raise InvalidRequest(
            f"{source} of {args.target} has no token positions recorded (only the serving engine records them)"
        )
    png = render_position_heatmap(
        stats.position_load,
        stats.moe_layers,
        stats.max_context or info.max_context,
        stats.top_k,
        info.name,
        dpi=args.dpi,
    )
    args.out.write_bytes(png)
    tokens = stats.position_load[0].sum() / max(stats.top_k, 1)
    print(
        f"wrote {args.out} ({len(png) // 1024} KiB): {len(stats.moe_layers)} MoE layers x {stats.num_experts} experts "
        f"by position, {tokens:,.0f} tokens from {source}",
        file=sys.stderr,
    )
    return 0


def _by_domain(args) -> int:
    from expertmesh.client import Client
    from expertmesh.observability import remote
    from expertmesh.observability.domain_heatmap import render_domain_heatmap

    if args.requests:
        raise InvalidRequest(
            "--requests: --by domain renders the router's counts by domain as they are; send labelled "
            "traffic with `expertmesh profile build` instead"
        )
    from expertmesh.observability.remote import domain_load

    with remote.Router(args.target, timeout=args.timeout) as router:
        info = router.model()
    with Client(args.target, timeout=args.timeout) as client:
        loads = domain_load(client)
    if not any(load.sum() > 0 for load in loads.values()):
        raise InvalidRequest(
            f"the router at {args.target} has counted no tokens by domain yet: send requests with a domain (or a "
            "policy that classifies), e.g. `expertmesh profile build`"
        )
    png = render_domain_heatmap(loads, tuple(info.moe_layers), info.top_k, info.name, dpi=args.dpi)
    args.out.write_bytes(png)
    print(
        f"wrote {args.out} ({len(png) // 1024} KiB): {len(info.moe_layers)} MoE layers x {info.num_experts} experts "
        f"by {len(loads)} domains",
        file=sys.stderr,
    )
    return 0
