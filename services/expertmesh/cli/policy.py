"""``expertmesh policy eval``: what a routing policy costs in quality and saves in compute, per domain.

Each labelled query (JSONL ``{"text", "domain"}``) is scored twice through the router, under ``exact``
and under the policy (domain given), and continued greedily twice. Reported per domain and overall:
KL(exact || policy) of the next-token distributions (nats per position), top-1 agreement, greedy-token
agreement, and routed-expert parameters per token the policy saves (from the router's expert choices by
domain during each scoring pass; other traffic of the same domain on that router meanwhile would count
too). With a shared state store (``--state-url``, or ``EXPERTMESH_STATE_URL``) the result is recorded
there, where routers' quality guard reads it. ``adaptive_k`` is measured at its floor (``queue_slo_ms`` 0,
whatever ``--queue-slo-ms`` says), the narrowest it serves, and recorded under a key without the SLO.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from expertmesh.config.settings import add_guard_arguments
from expertmesh.contracts.errors import InvalidRequest

#: routing_policy.PARAMETER_NAMES (not imported: that module needs torch, the parser must not)
_PARAMETERS = (
    "alpha",
    "top_n",
    "delta",
    "weight_boost",
    "threshold",
    "k_start",
    "decay",
    "k_min",
    "tau",
    "capacity_factor",
    "k_max",
    "noise_scale",
    "sticky_strength",
    "sticky_decay",
    "queue_slo_ms",
)


def add_command(commands) -> None:
    policy = commands.add_parser("policy", help="routing policies: measure their quality against exact routing")
    sub = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    ev = sub.add_parser("eval", help="KL, top-1 and greedy agreement, and parameters saved, per domain")
    ev.add_argument("--policy", required=True, help="policy name, e.g. delta_gap or prefer+dynamic_k")
    for name in _PARAMETERS:
        ev.add_argument(
            f"--{name.replace('_', '-')}", dest=name, type=float, help=f"the policy's {name} (default: the server's)"
        )
    ev.add_argument("--queries", type=Path, required=True, help='JSONL file of {"text": ..., "domain": ...} lines')
    ev.add_argument("--target", default="127.0.0.1:50051", help="the router's gRPC address (default 127.0.0.1:50051)")
    ev.add_argument(
        "--state-url",
        help="record the result in this shared store (default: env EXPERTMESH_STATE_URL; unset: not recorded)",
    )
    ev.add_argument("--max-tokens", type=int, default=16, help="greedy tokens compared per query (default 16)")
    ev.add_argument("--timeout", type=float, default=120.0, help="deadline of each call, seconds (default 120)")
    ev.add_argument(
        "--guard",
        choices=["self", "embedding"],
        help="also the consistency guard with this scorer: the policy's greedy tokens that differ from exact's "
        "(the bad-case rate) without and with it, and the time per token it adds",
    )
    add_guard_arguments(ev)
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(run=_eval)


def _eval(args) -> int:
    from expertmesh.classifier.corpus import load_examples
    from expertmesh.client import Client
    from expertmesh.verify.policy import evaluate, evaluate_guard

    if args.max_tokens < 1:
        raise InvalidRequest("--max-tokens must be at least 1")
    examples = load_examples(args.queries)
    given = {name: getattr(args, name) for name in _PARAMETERS if getattr(args, name) is not None}
    with Client(args.target, timeout=args.timeout) as client:
        result = evaluate(client, args.target, args.policy, given, examples, args.max_tokens)
        guard = None
        if args.guard:
            guard = evaluate_guard(
                client,
                args.target,
                args.policy,
                given,
                examples,
                args.max_tokens,
                args.guard,
                args.guard_threshold,
                args.guard_recompute,
            )
    recorded = _record(args, result)
    if args.json:
        extra = {"consistency_guard": guard.to_dict()} if guard else {}
        print(json.dumps({**json.loads(result.to_json()), "recorded": recorded, **extra}))
        return 0
    print(f"policy {result.policy} on {len(examples)} queries ({args.target})")
    print(f"{'domain':>14} {'KL nats':>9} {'top-1':>7} {'greedy':>7} {'params saved/token':>19} {'positions':>9}")
    for domain, f in [*result.per_domain.items(), ("all", result.overall)]:
        print(
            f"{domain:>14} {f.kl:>9.4f} {f.top1_agreement:>7.1%} {f.greedy_agreement:>7.1%} "
            f"{f.saved_params_per_token:>19,.0f} {f.positions:>9}"
        )
    if guard is not None:
        print(
            f"consistency guard {guard.scorer} (threshold {guard.threshold:g}, {guard.recompute}): bad-case rate "
            f"{guard.bad_rate:.1%} -> {guard.bad_rate_guarded:.1%} of {guard.positions} greedy tokens; "
            f"{guard.ms_per_token:.1f} -> {guard.ms_per_token_guarded:.1f} ms per token "
            f"({guard.added_ms_per_token:+.1f})"
        )
    print(
        f"recorded in {recorded}"
        if recorded
        else "not recorded (no --state-url): routers' quality guard will not see it",
        file=sys.stderr,
    )
    return 0


def _record(args, result) -> str | None:
    url = args.state_url or os.environ.get("EXPERTMESH_STATE_URL")
    if not url or url.startswith("memory://"):
        return None
    from expertmesh.store import open_store

    store = open_store(url)
    try:
        store.save_policy_quality(result.policy, result.to_json().encode())
    finally:
        store.close()
    return url
