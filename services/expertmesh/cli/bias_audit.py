"""``expertmesh probe --labels FILE``: the bias audit of a running model's routing.

Each labelled prompt (JSONL ``{"text", "labels": {dimension: value}}``, ``expertmesh.observability.labels``)
is generated greedily for ``--max-tokens`` tokens under ``exact`` routing with its routing trace, and again
under ``--policy NAME`` when given. Its activations are those of the traced forwards (the prompt's last
position and each new token but the last: ``--max-tokens`` per prompt); the API traces no other prompt
position. Reported per dimension=value and MoE layer: each expert's share of the value's activations as a
heatmap, every share above ``--threshold`` (default 0.40) flagged, each dimension's disparity and the
policy's demographic parity difference against exact. Definitions: ``expertmesh.observability.bias``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.observability.bias import DEFAULT_THRESHOLD, AuditReport, Spread

#: Up to this many experts per layer the heatmap shows every expert; wider, the largest shares.
FULL_HEATMAP_UP_TO = 32


def add_arguments(parser) -> None:
    parser.add_argument(
        "--labels",
        type=Path,
        help='bias audit: JSONL of {"text": ..., "labels": {"gender": "female", ...}} prompts; reports each '
        "expert's share of each label value's activations instead of the sparsity report",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help=f"--labels: flag an expert above this share of a value's activations (default {DEFAULT_THRESHOLD})",
    )
    parser.add_argument(
        "--policy",
        help="--labels: also run under this routing policy and report its demographic parity difference against exact",
    )


def check_arguments(args) -> None:
    """Refuse what the audit would silently ignore or cannot do, before connecting."""
    if not 0 <= args.threshold <= 1:
        raise InvalidRequest(f"--threshold must be between 0 and 1, got {args.threshold}")
    if args.labels is None:
        for flag, given in (
            ("--policy", args.policy is not None),
            ("--threshold", args.threshold != DEFAULT_THRESHOLD),
        ):
            if given:
                raise InvalidRequest(f"{flag} belongs to the bias audit: pass --labels FILE")
        return
    for flag, given in (("--prompts", args.prompts is not None), ("--placement", args.placement is not None)):
        if given:
            raise InvalidRequest(f"{flag} is not used by the bias audit (--labels): leave it out")
    if args.max_tokens < 1:
        raise InvalidRequest(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.policy is not None and (not args.policy.strip() or args.policy == "exact"):
        raise InvalidRequest("--policy: name a routing policy other than exact (exact is always run)")


def run(args) -> int:
    from expertmesh.observability import remote
    from expertmesh.observability.bias import ValueCounts, add_activations, audit
    from expertmesh.observability.labels import MAX_FILE_BYTES, LabelsError, parse_labels

    path: Path = args.labels
    if not path.is_file():
        raise InvalidRequest(f"--labels {path}: no such file")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise LabelsError(f"--labels {path}: {path.stat().st_size} bytes, above {MAX_FILE_BYTES}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LabelsError(f"--labels {path}: not UTF-8") from None
    prompts = parse_labels(text, str(path))
    policies = ["exact"] + ([args.policy] if args.policy else [])
    counts: dict = {p: {} for p in policies}
    with remote.Router(args.target, timeout=args.timeout) as router:
        info = router.model()
        layers, E = tuple(info.moe_layers), info.num_experts
        for p in policies:
            traces = router.trace(
                [x.text for x in prompts],
                args.max_tokens,
                policy=p,
                concurrency=args.concurrency,
                names=[f"{path} line {x.line}" for x in prompts],
            )
            for prompt, tokens in zip(prompts, traces):  # counted as they come, not held
                for label in prompt.labels.items():
                    c = counts[p].setdefault(label, ValueCounts(np.zeros((len(layers), E))))
                    c.prompts += 1
                    c.tokens += len(tokens)
                    for token in tokens:
                        add_activations(c.activations, layers, token)
    if not any(c.activations.sum() for c in counts["exact"].values()):
        raise InvalidRequest(
            f"the router at {args.target} traced no expert activations (its experts are not dispatched?)"
        )
    report = audit(counts, layers, E, info.top_k, args.threshold)
    if args.json:
        out = {"target": args.target, "model": info.name, "labels": str(path), "prompts": len(prompts)}
        print(json.dumps(out | {"max_tokens": args.max_tokens} | report.to_dict(), indent=2))
    else:
        print(format_audit(report, info.name, args.target, str(path), len(prompts), args.max_tokens))
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def format_audit(report: AuditReport, model: str, target: str, labels: str, prompts: int, max_tokens: int) -> str:
    E, k = report.num_experts, report.top_k
    dims = report.dimensions()
    runs = " and ".join(report.counts)
    lines = [
        f"{model} at {target}: {len(report.moe_layers)} MoE layers x {E} experts, top-{k}",
        f"bias audit of {labels}: {prompts} prompts, "
        + ", ".join(f"{d} ({len(v)} values)" for d, v in dims.items())
        + f"; {max_tokens} greedy tokens each, under {runs}",
        f"share = an expert's share of a value's activations in a layer (%); even {_pct(1 / E)}, at most "
        f"{_pct(report.ceiling)} (1/k); * = above the threshold {_pct(report.threshold)}",
    ]
    if report.threshold >= report.ceiling:
        lines.append(
            f"note: with top-{k} no share can exceed {_pct(report.ceiling)}%, so nothing can be flagged at "
            f"--threshold {report.threshold:g}; lower it"
        )
    for policy, run in report.counts.items():
        for dimension, values in dims.items():
            lines += ["", f"{dimension}, under {policy}"]
            lines += _heatmap(report, run, dimension, values)
    for policy, flags in report.flags.items():
        lines += ["", f"flagged under {policy}: {len(flags)} (layer, expert, value) above {_pct(report.threshold)}%"]
        if flags:
            rows = [
                (str(f.layer), f"e{f.expert}", f"{f.dimension}={f.value}", _pct(f.share), f"{f.activations:,.0f}")
                for f in flags
            ]
            lines += _table(("layer", "expert", "label", "share %", "activations"), rows)
    lines += ["", "disparity: the largest gap across a dimension's values of an expert's share (points)"]
    header = ["dimension", "values", *(f"under {p}" for p in report.counts), "where (under exact)"]
    rows = []
    for dimension, values in dims.items():
        spreads = [report.disparity[p][dimension] for p in report.counts]
        rows.append((dimension, str(len(values)), *(_spread_amount(s) for s in spreads), _where(spreads[0])))
    lines += _table(header, rows)
    if report.policy is not None:
        lines += [
            "",
            f"demographic parity difference of {report.policy} against exact: the largest gap across a dimension's "
            f"values of (share under {report.policy} - share under exact) (points)",
        ]
        rows = [(d, _spread_amount(s), _where(s, signed=True)) for d, s in report.parity.items()]
        lines += _table(("dimension", "difference", "where"), rows)
    return "\n".join(lines)


def _spread_amount(s: Spread | None) -> str:
    return "-" if s is None else _pct(s.difference)


def _where(s: Spread | None, signed: bool = False) -> str:
    if s is None:
        return "one value only"
    if s.difference == 0:
        return "every value alike"
    fmt = (lambda x: f"{100 * x:+.1f}") if signed else _pct
    return f"layer {s.layer} e{s.expert}: {s.high_value} {fmt(s.high_amount)}, {s.low_value} {fmt(s.low_amount)}"


def _heatmap(report: AuditReport, run: dict, dimension: str, values: list[str]) -> list[str]:
    from expertmesh.observability.bias import shares

    E = report.num_experts
    rows = []
    for row, layer in enumerate(report.moe_layers):
        for i, value in enumerate(values):
            c = run.get((dimension, value))
            if c is None:
                continue
            s = shares(c.activations)[row]
            head = (str(layer) if i == 0 else "", value, str(c.prompts), str(c.tokens))
            cells = [_pct(x) + ("*" if x > report.threshold else " ") for x in s]
            if E <= FULL_HEATMAP_UP_TO:
                rows.append((*head, *cells))
            else:
                top = np.argsort(-s, kind="stable")[:6]
                rows.append((*head, ", ".join(f"e{e} {cells[e].strip()}" for e in top)))
    experts = [f"e{e}" for e in range(E)] if E <= FULL_HEATMAP_UP_TO else ["largest shares %"]
    return _table(("layer", "value", "prompts", "tokens", *experts), rows)


def _table(header, rows) -> list[str]:
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*header), *(fmt.format(*row) for row in rows)]
