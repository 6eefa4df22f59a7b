"""``expertmesh policy eval``: what a routing policy costs in quality and saves in compute, per domain.

Each labelled query (JSONL ``{"text", "domain"}``) is scored twice through the router, under ``exact``
and under the policy (domain given), and continued greedily twice. Reported per domain and overall:
KL(exact || policy) of the next-token distributions (nats per position), top-1 agreement, greedy-token
agreement, and routed-expert parameters per token the policy saves (from the router's expert choices by
domain during each scoring pass; other traffic of the same domain on that router meanwhile would count
too). With a shared state store (``--state-url``, or ``EXPERTMESH_STATE_URL``) the result is recorded
there, where routers' quality guard reads it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest

_PARAMETERS = ("alpha", "top_n", "delta", "weight_boost", "threshold")


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
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(run=_eval)


def _eval(args) -> int:
    import grpc

    from expertmesh.classifier.corpus import load_examples
    from expertmesh.cli.profile import domain_load
    from expertmesh.client import Client
    from expertmesh.contracts import wire
    from expertmesh.router.policy.quality import PolicyQuality, Tally, kl_and_top1, same_positions
    from expertmesh.router.policy.routing_policy import PolicyError, parse_policy
    from expertmesh.v1 import inference_pb2 as pb

    if args.max_tokens < 1:
        raise InvalidRequest("--max-tokens must be at least 1")
    examples = load_examples(args.queries)
    given = {name: getattr(args, name) for name in _PARAMETERS if getattr(args, name) is not None}
    with Client(args.target, timeout=args.timeout) as client:
        try:
            info = client.models()[0]
        except grpc.RpcError as err:
            raise ExpertMeshError(
                f"cannot reach the router at {args.target}: {err.code().name}: {err.details()}"
            ) from None
        try:
            policy = parse_policy(args.policy, given, info.top_k, info.num_experts)
        except PolicyError as err:
            flag = "--policy" if err.field.endswith(".name") else "--" + err.field.rsplit(".", 1)[1].replace("_", "-")
            raise InvalidRequest(f"{flag}: {str(err).split(': ', 1)[1]}") from None
        wanted = pb.RoutingPolicy(name=policy.name, force=True, **{k: v for k, v in policy.active().items()})
        exact = pb.RoutingPolicy(name="exact")

        def call(what, *a, **kw):
            try:
                return what(*a, **kw)
            except grpc.RpcError as err:
                raise ExpertMeshError(f"{args.target}: {err.code().name}: {err.details()}") from None

        def score_all(routing):
            """Each query's next-token log-probs [P, V] under ``routing``, and each domain's expert choices."""
            before = domain_load(client)
            out = [
                wire.decode(
                    call(
                        client.score, e.text, full_distribution=True, routing_policy=routing, domain=e.domain
                    ).distribution
                )
                for e in examples
            ]
            after = domain_load(client)
            return out, {d: float((load - before.get(d, 0)).sum()) for d, load in after.items()}

        def greedy(example, routing) -> list[int]:
            chunks = call(
                lambda: list(
                    client.generate(
                        example.text,
                        max_new_tokens=args.max_tokens,
                        stop_at_eos=False,
                        routing_policy=routing,
                        domain=example.domain,
                    )
                )
            )
            return [t for c in chunks for t in c.token_ids]

        exact_logp, exact_choices = score_all(exact)
        policy_logp, policy_choices = score_all(wanted)
        tallies: dict[str, Tally] = {}
        for example, le, lp in zip(examples, exact_logp, policy_logp):
            tally = tallies.setdefault(example.domain, Tally())
            kl, top1 = kl_and_top1(le, lp)
            a, b = greedy(example, exact), greedy(example, wanted)
            tally.kl += kl
            tally.top1 += top1
            tally.positions += le.shape[0]
            tally.tokens += le.shape[0]
            tally.greedy_same += same_positions(a, b)
            tally.greedy_positions += min(len(a), len(b))
    overall = Tally()
    for domain, tally in tallies.items():
        tally.choices_exact = exact_choices.get(domain, 0.0)
        tally.choices_policy = policy_choices.get(domain, 0.0)
        for name in vars(overall):
            setattr(overall, name, getattr(overall, name) + getattr(tally, name))
    ppe = info.parameters_per_expert
    result = PolicyQuality(policy.key, overall.figures(ppe), {d: t.figures(ppe) for d, t in sorted(tallies.items())})
    recorded = _record(args, result)
    if args.json:
        print(json.dumps({**json.loads(result.to_json()), "recorded": recorded}))
        return 0
    print(f"policy {result.policy} on {len(examples)} queries ({args.target})")
    print(f"{'domain':>14} {'KL nats':>9} {'top-1':>7} {'greedy':>7} {'params saved/token':>19} {'positions':>9}")
    for domain, f in [*result.per_domain.items(), ("all", result.overall)]:
        print(
            f"{domain:>14} {f.kl:>9.4f} {f.top1_agreement:>7.1%} {f.greedy_agreement:>7.1%} "
            f"{f.saved_params_per_token:>19,.0f} {f.positions:>9}"
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
