"""``expertmesh policy eval``: what a routing policy costs in quality and saves in compute, per domain; and
``expertmesh policy canary start|status|promote|stop``: a candidate policy on a share of a router's default-policy
traffic (its RouterAdmin API, ``serving.canary``), with per-arm figures, promoted to the default or stopped.

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
    canary = sub.add_parser("canary", help="a candidate policy on a share of a router's default-policy traffic")
    canary.add_argument("action", choices=_CANARY_ACTIONS, help="start, status, promote (to the default) or stop")
    canary.add_argument("--target", default="127.0.0.1:50051", help="the router's gRPC address")
    canary.add_argument("--policy", help="start: the candidate policy, e.g. delta_gap")
    canary.add_argument(
        "--param", action="append", default=[], metavar="K=V", help="start: one of the candidate's parameters"
    )
    canary.add_argument("--share", type=float, help="start: the candidate's share of keys, in (0, 0.5]")
    canary.add_argument("--min-agreement", type=float, help="start: stop itself below this agreement (default 0.9)")
    canary.add_argument("--min-samples", type=int, help="start: samples before it judges (default 200)")
    canary.add_argument("--sample-every", type=int, help="start: sample every n-th new token (default 16)")
    canary.add_argument("--force", action="store_true", help="start even past the quality guard's KL bound")
    canary.add_argument("--timeout", type=float, default=10.0, help="deadline of the call, seconds (default 10)")
    canary.add_argument("--json", action="store_true", help="print the status as JSON")
    canary.set_defaults(run=_canary)


_CANARY_ACTIONS = ("start", "status", "promote", "stop")
_COUNTS = ("requests", "finished", "sampled_tokens", "agreeing_tokens")


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


def _canary(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from expertmesh.infra.security.admin_auth import admin_metadata
    from expertmesh.infra.security.tls import secure_or_insecure_channel
    from expertmesh.v1 import inference_pb2 as pb
    from expertmesh.v1 import inference_pb2_grpc as pb_grpc

    request = pb.CanaryRequest(action=pb.CanaryAction.Value(f"CANARY_{args.action.upper()}"))
    if args.action == "start":
        if not args.policy or args.share is None:
            raise InvalidRequest("canary start needs --policy and --share")
        request.candidate.CopyFrom(_candidate(pb, args.policy, args.param, args.force))
        request.share = args.share
        for name in ("min_agreement", "min_samples", "sample_every"):
            if getattr(args, name) is not None:
                setattr(request, name, getattr(args, name))
    with secure_or_insecure_channel(args.target) as channel:
        try:
            status = pb_grpc.RouterAdminStub(channel).Canary(request, timeout=args.timeout, metadata=admin_metadata())
        except grpc.RpcError as err:
            raise InvalidRequest(f"{err.code().name}: {err.details()}") from None
    if args.json:
        shown = MessageToDict(status, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
        shown["arms"] = [  # counts as numbers (proto JSON writes 64-bit integers as strings)
            {k: int(v) if k in _COUNTS else v for k, v in arm.items()} for arm in shown["arms"]
        ]
        print(json.dumps(shown))
        return 0
    if not status.state:
        print(f"no canary started on {args.target}")
        return 0
    print(
        f"canary {status.state}: {status.candidate} on {status.share:.1%} of default-policy keys "
        f"(baseline {status.baseline}); auto-stop below {status.min_agreement:.1%} agreement after "
        f"{status.min_samples} samples, every {status.sample_every} tokens"
    )
    if status.reason:
        print(f"  {status.reason}")
    print(f"{'arm':>10} {'requests':>9} {'finished':>9} {'mean s':>8} {'sampled':>8} {'agree':>7}  policy")
    for arm in status.arms:
        agree = f"{arm.agreeing_tokens / arm.sampled_tokens:.1%}" if arm.sampled_tokens else "-"
        print(
            f"{arm.arm:>10} {arm.requests:>9} {arm.finished:>9} {arm.mean_latency_s:>8.3f} {arm.sampled_tokens:>8} "
            f"{agree:>7}  {arm.policy}"
        )
    return 0


def _candidate(pb, name: str, params: list[str], force: bool):
    """--policy and its --param K=V as a RoutingPolicy message (the router checks the ranges)."""
    message = pb.RoutingPolicy(name=name, force=force)
    for item in params:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _PARAMETERS:
            raise InvalidRequest(f"--param {item!r}: expected K=V with K one of {', '.join(_PARAMETERS)}")
        try:
            number = float(value)
        except ValueError:
            raise InvalidRequest(f"--param {key}: {value!r} is not a number") from None
        field = message.DESCRIPTOR.fields_by_name[key]
        integer = field.cpp_type == field.CPPTYPE_UINT32  # top_n, k_start, k_min, k_max
        if integer and (number != int(number) or number < 0):
            raise InvalidRequest(f"--param {key}: takes a whole number, got {value!r}")
        setattr(message, key, int(number) if integer else number)
    return message
