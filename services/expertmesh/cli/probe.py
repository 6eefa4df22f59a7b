"""``expertmesh probe``: how sparse and how balanced a running model's routing is.

Sends ``--requests N`` generations to a router and reports, from the router's
load counts before and after (so over those requests, plus any other traffic
meanwhile), per MoE layer and overall: active parameters per token and their
share of all parameters, the spread of expert load, each expert's utilisation,
routing entropy against its maximum, experts never or rarely used,
balancedness over expert groups, and the spread (p5 / p50 / p95) of active
parameters per token of the finished sequences, overall and per query-length
bucket. ``--requests 0`` sends nothing and reports the
router's whole load window (sampling the existing traffic). A table by default,
JSON with ``--json``. Definitions: ``expertmesh.observability.sparsity``.

``--labels FILE`` runs the bias audit instead (``expertmesh.cli.bias_audit``): each expert's share of each
label value's activations, concentrations over ``--threshold``, and ``--policy``'s parity against exact.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from expertmesh.cli import bias_audit
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.observability.sparsity import DEFAULT_RARE_THRESHOLD, SparsityReport, active_spread, analyse

#: Up to this many experts per layer the table shows every expert's utilisation.
FULL_UTILISATION_UP_TO = 32


def add_traffic_arguments(parser, requests_default: int) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051", help="a router's gRPC address")
    parser.add_argument(
        "--requests",
        type=int,
        default=requests_default,
        help=f"generations to send first and report on (0: the router's whole load window; default {requests_default})",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    parser.add_argument("--prompts", type=Path, help="text file, one prompt per line (default: built-in mixed prompts)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the first request (default 0)")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of the stats calls, seconds")


def add_command(commands) -> None:
    parser = commands.add_parser(
        "probe", help="send requests and report active parameters, expert utilisation, routing entropy and balance"
    )
    add_traffic_arguments(parser, requests_default=16)
    parser.add_argument(
        "--placement", type=Path, help="placement YAML of the router's groups (default: assume the contiguous split)"
    )
    parser.add_argument(
        "--rare-threshold",
        type=float,
        default=DEFAULT_RARE_THRESHOLD,
        help=f"utilisation below which a used expert counts as rarely used (default {DEFAULT_RARE_THRESHOLD})",
    )
    bias_audit.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.set_defaults(run=_main)


def check_traffic_arguments(args) -> list[str] | None:
    """Validate before connecting; returns the prompts of --prompts (None = built-in)."""
    if args.requests < 0:
        raise InvalidRequest(f"--requests must be 0 or more, got {args.requests}")
    if args.max_tokens < 1:
        raise InvalidRequest(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.prompts is None:
        return None
    if not args.prompts.is_file():
        raise InvalidRequest(f"prompts file {args.prompts} does not exist")
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    if not prompts:
        raise InvalidRequest(f"prompts file {args.prompts} has no prompts")
    return prompts


def collect(router, info, args, prompts):
    """(load stats to report on, traffic sent or None, a description of the source)."""
    if args.requests == 0:
        stats = router.load_stats()
        return stats, None, "the router's whole load window"
    before = router.load_stats()
    kwargs = {"prompts": prompts} if prompts else {}
    traffic = router.send(
        args.requests, args.max_tokens, args.concurrency, vocab_size=info.vocab_size, seed=args.seed, **kwargs
    )
    return router.load_stats() - before, traffic, f"the load added by {args.requests} probe requests"


def _main(args) -> int:
    from expertmesh.contracts.load_window import query_bucket_labels  # (torch: not while building the parser)
    from expertmesh.observability import remote

    bias_audit.check_arguments(args)
    if args.labels is not None:
        return bias_audit.run(args)
    prompts = check_traffic_arguments(args)
    if not 0 <= args.rare_threshold <= 1:
        raise InvalidRequest(f"--rare-threshold must be between 0 and 1, got {args.rare_threshold}")
    with remote.Router(args.target, timeout=args.timeout) as router:
        info = router.model()
        groups, placement = remote.expert_groups(info, args.placement)
        stats, traffic, source = collect(router, info, args, prompts)
    remote.check_not_empty(stats, args.target, source)
    model = remote.model_shape(info)
    report = analyse(stats.load, model, groups, placement, args.rare_threshold)
    if stats.experts_per_token.size and stats.query_length_edges:
        labels = query_bucket_labels(stats.query_length_edges)
        report = dataclasses.replace(report, spread=active_spread(stats.experts_per_token, model, labels))
    if args.json:
        out = report.to_dict() | {"target": args.target, "source": source}
        out["traffic"] = None if traffic is None else traffic.__dict__
        print(json.dumps(out, indent=2))
    else:
        print(format_table(report, args.target, source, traffic))
    return 0


def _count(n: float) -> str:
    return f"{n:,.0f}"


def format_table(report: SparsityReport, target: str, source: str, traffic=None) -> str:
    m = report.model
    lines = [f"{m.name} at {target}: {len(m.moe_layers)} MoE layers x {m.num_experts} experts, top-{m.top_k}"]
    if traffic is not None:
        lines.append(
            f"sent {traffic.requests} requests ({traffic.prompt_tokens} prompt + {traffic.completion_tokens} "
            f"completion tokens) in {traffic.seconds:.1f} s"
        )
    lines.append(f"over {source}: {report.tokens:,.0f} tokens per MoE layer")
    lines.append(f"groups: {report.placement}")
    lines.append("")
    header = (
        "layer",
        "tokens",
        "experts/tok",
        "active params/tok",
        "load std",
        "load CV",
        "entropy bits",
        "util min",
        "util max",
        "never",
        f"rare(<{report.rare_threshold:g})",
        "balancedness",
    )
    rows = []
    for layer in report.layers:
        rows.append(
            (
                str(layer.layer),
                _count(layer.tokens),
                f"{layer.pairs_per_token:.2f}",
                _count(layer.active_expert_parameters),
                f"{layer.load_std:.1f}",
                f"{layer.load_cv:.3f}",
                f"{layer.entropy_bits:.3f} / {layer.max_entropy_bits:.3f}",
                f"{min(layer.utilisation):.2f}",
                f"{max(layer.utilisation):.2f}",
                _ids(layer.never_used),
                _ids(layer.rarely_used),
                "-" if layer.balancedness is None else f"{layer.balancedness:.3f}",
            )
        )
    balanced = report.mean_balancedness
    rows.append(
        (
            "all",
            _count(report.tokens),
            f"{sum(layer.pairs_per_token for layer in report.layers):.2f}",
            f"{_count(report.active_parameters_per_token)} ({100 * report.active_share:.1f}%)",
            f"{report.mean_load_std:.1f}",
            f"{report.mean_load_cv:.3f}",
            f"{report.mean_entropy_bits:.3f} / {report.max_entropy_bits:.3f}",
            f"{report.min_utilisation:.2f}",
            f"{report.max_utilisation:.2f}",
            str(sum(len(layer.never_used) for layer in report.layers)),
            str(sum(len(layer.rarely_used) for layer in report.layers)),
            "-" if balanced is None else f"{balanced:.3f}",
        )
    )
    lines += _table(header, rows)
    lines.append(
        f"active parameters per token: {_count(report.active_parameters_per_token)} of {_count(m.total_parameters)} "
        f"({100 * report.active_share:.1f}%) = {_count(m.dense_parameters)} dense + routed experts "
        f"({_count(m.parameters_per_expert)} per expert); 'all' row: sums for experts/tok and params, means for "
        "std/CV/entropy/balancedness, counts for never/rare"
    )
    lines += _spread_lines(report)
    lines.append("")
    lines.append("utilisation per expert (1.00 = its fair share of the layer's tokens)")
    if m.num_experts <= FULL_UTILISATION_UP_TO:
        header = ("layer", *(f"e{e}" for e in range(m.num_experts)))
        rows = [(str(layer.layer), *(f"{u:.2f}" for u in layer.utilisation)) for layer in report.layers]
        lines += _table(header, rows)
    else:
        for layer in report.layers:
            order = sorted(range(m.num_experts), key=lambda e: layer.utilisation[e])
            low = ", ".join(f"e{e} {layer.utilisation[e]:.2f}" for e in order[:4])
            high = ", ".join(f"e{e} {layer.utilisation[e]:.2f}" for e in reversed(order[-4:]))
            lines.append(f"  layer {layer.layer}: lowest {low}; highest {high}")
    lines.append("")
    lines.append("group load share per layer (balancedness = mean / max)")
    names = sorted({name for layer in report.layers for name in layer.group_load})
    rows = []
    for layer in report.layers:
        total = sum(layer.group_load.values()) or 1.0
        rows.append(
            (
                str(layer.layer),
                *(
                    f"{100 * layer.group_load[name] / total:.1f}%" if name in layer.group_load else "-"
                    for name in names
                ),
            )
        )
    lines += _table(("layer", *names), rows)
    return "\n".join(lines)


def _spread_lines(report: SparsityReport) -> list[str]:
    """The spread of active parameters per token, overall and per query-length bucket (buckets with tokens)."""
    if not report.spread or not report.spread[0].tokens:
        return ["", "active parameters per token spread: no finished sequences counted yet"]
    rows = [
        (s.label, _count(s.tokens), *(_count(v) for v in (s.p5, s.p50, s.p95)))
        for s in report.spread
        if s.tokens or s.label == "all"
    ]
    return [
        "",
        "active parameters per token of finished sequences, by query length (prompt tokens)",
        *_table(("query length", "tokens", "p5", "p50", "p95"), rows),
    ]


def _ids(experts) -> str:
    if not experts:
        return "-"
    shown = ",".join(str(e) for e in experts[:6])
    return shown + (f" +{len(experts) - 6}" if len(experts) > 6 else "")


def _table(header, rows) -> list[str]:
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*header), *(fmt.format(*row) for row in rows)]
