"""``expertmesh heatmap``: expert x token-position activation frequency per MoE layer, as a PNG.

From the router's recorded routing (``GetLoadStats``): its whole load window by
default, or only the load added by ``--requests N`` generations the command sends
first. ``--positions relative`` (the default) places each token at its position /
its sequence's final length, bins over 0-1 (``relative_load``: finished sequences
only); ``--positions absolute`` at its position, bins over the model's context
(``position_load``). ``--by domain``: expert x query domain
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
    parser.add_argument(
        "--positions",
        choices=("relative", "absolute"),
        default="relative",
        help="--by position: a token's position / its sequence's final length, bins over 0-1 (relative, the "
        "default), or its position, bins over the context (absolute)",
    )
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
    counts = stats.relative_load if args.positions == "relative" else stats.position_load
    if counts.size == 0 or counts.sum() <= 0:
        what = (
            "no finished sequences' relative positions recorded (the serving engine records them as sequences "
            "finish; --positions absolute counts every token)"
            if args.positions == "relative"
            else "no token positions recorded (only the serving engine records them)"
        )
        raise InvalidRequest(f"{source} of {args.target} has {what}")
    png = render_position_heatmap(
        counts,
        stats.moe_layers,
        stats.max_context or info.max_context,
        stats.top_k,
        info.name,
        dpi=args.dpi,
        positions=args.positions,
    )
    args.out.write_bytes(png)
    tokens = counts[0].sum() / max(stats.top_k, 1)
    print(
        f"wrote {args.out} ({len(png) // 1024} KiB): {len(stats.moe_layers)} MoE layers x {stats.num_experts} experts "
        f"by {args.positions} position, {tokens:,.0f} tokens from {source}",
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
