"""``expertmesh policy eval``'s measurement: what a routing policy costs in quality and saves in compute, per
query domain, against exact routing, through a running router's Inference API. For each labelled query: the
next-token distributions of its prompt under both (Score, full distribution: KL and top-1 agreement), greedy
completions under both (agreement by position), and the expert choices each made (from the router's domain
load before and after). The figures are ``router.policy.quality``'s ``PolicyQuality``, which routers'
quality guard reads from the store."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc

from expertmesh.classifier.corpus import Example
from expertmesh.client import Client
from expertmesh.contracts import wire
from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest
from expertmesh.observability.remote import domain_load
from expertmesh.router.policy.quality import PolicyQuality, Tally, kl_and_top1, same_positions
from expertmesh.router.policy.routing_policy import PolicyError, parse_policy
from expertmesh.v1 import inference_pb2 as pb


def evaluate(
    client: Client,
    target: str,
    policy_name: str,
    given: Mapping[str, float],
    examples: Sequence[Example],
    max_tokens: int,
) -> PolicyQuality:
    """``policy_name`` with the parameters ``given`` (the rest the router's defaults) on ``examples``, against
    exact routing, through ``client`` (the router at ``target``, named in errors)."""

    def call(what, *a, **kw):
        try:
            return what(*a, **kw)
        except grpc.RpcError as err:
            raise ExpertMeshError(f"{target}: {err.code().name}: {err.details()}") from None

    try:
        info = client.models()[0]
    except grpc.RpcError as err:
        raise ExpertMeshError(f"cannot reach the router at {target}: {err.code().name}: {err.details()}") from None
    try:
        policy = parse_policy(policy_name, dict(given), info.top_k, info.num_experts)
    except PolicyError as err:
        flag = "--policy" if err.field.endswith(".name") else "--" + err.field.rsplit(".", 1)[1].replace("_", "-")
        raise InvalidRequest(f"{flag}: {str(err).split(': ', 1)[1]}") from None
    wanted = pb.RoutingPolicy(name=policy.name, force=True, **{k: v for k, v in policy.active().items()})
    exact = pb.RoutingPolicy(name="exact")

    def score_all(routing):
        """Each query's next-token log-probs [P, V] under ``routing``, and each domain's expert choices."""
        before = domain_load(client)
        out = [
            wire.decode(
                call(client.score, e.text, full_distribution=True, routing_policy=routing, domain=e.domain).distribution
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
                    max_new_tokens=max_tokens,
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
    return PolicyQuality(policy.key, overall.figures(ppe), {d: t.figures(ppe) for d, t in sorted(tallies.items())})
