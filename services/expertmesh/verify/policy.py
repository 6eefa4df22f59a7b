"""``expertmesh policy eval``'s measurement: what a routing policy costs in quality and saves in compute, per
query domain, against exact routing, through a running router's Inference API. For each labelled query: the
next-token distributions of its prompt under both (Score, full distribution: KL and top-1 agreement), greedy
completions under both (agreement by position), and the expert choices each made (from the router's domain
load before and after). The figures are ``router.policy.quality``'s ``PolicyQuality``, which routers'
quality guard reads from the store."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import grpc

from expertmesh.classifier.corpus import Example
from expertmesh.client import Client
from expertmesh.config.settings import GUARD_THRESHOLD
from expertmesh.contracts import wire
from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest
from expertmesh.observability.remote import domain_load
from expertmesh.router.policy.quality import PolicyQuality, Tally, kl_and_top1, same_positions
from expertmesh.router.policy.routing_policy import PolicyError, RoutingPolicy, parse_policy
from expertmesh.v1 import inference_pb2 as pb


def guard_threshold(guard: pb.ConsistencyGuard) -> float:
    """The threshold ``guard`` is served with: its own, or the guard's default."""
    return guard.threshold if guard.HasField("threshold") else GUARD_THRESHOLD


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

    info, policy, wanted = policy_request(client, target, policy_name, given)
    exact = EXACT

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
        return _greedy(client, target, example, max_tokens, routing)[0]

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


@dataclass(frozen=True)
class GuardFigures:
    """The consistency guard on a policy's greedy answers: the share of tokens that differ from exact's
    (by position) without and with it, and the client's time per generated token of each."""

    policy: str
    scorer: str
    threshold: float
    recompute: str
    bad_rate: float
    bad_rate_guarded: float
    ms_per_token: float
    ms_per_token_guarded: float
    positions: int

    @property
    def added_ms_per_token(self) -> float:
        return self.ms_per_token_guarded - self.ms_per_token

    def to_dict(self) -> dict:
        return {**asdict(self), "added_ms_per_token": self.added_ms_per_token}


def evaluate_guard(
    client: Client,
    target: str,
    policy_name: str,
    given: Mapping[str, float],
    examples: Sequence[Example],
    max_tokens: int,
    scorer: str,
    threshold: float | None = None,
    recompute: str = "widened",
) -> GuardFigures:
    """``policy_name``'s greedy answers to ``examples`` without and with the consistency guard ``scorer``,
    each against exact routing's, through ``client`` (the router at ``target``)."""
    _, policy, wanted = policy_request(client, target, policy_name, given)
    guard = pb.ConsistencyGuard(scorer=scorer, recompute=recompute)
    if threshold is not None:
        guard.threshold = threshold
    off = pb.ConsistencyGuard(scorer="")  # not the server's default either

    def greedy(example, routing, consistency_guard) -> tuple[list[int], float]:
        return _greedy(client, target, example, max_tokens, routing, consistency_guard)

    same = same_guarded = positions = tokens = tokens_guarded = 0
    seconds = seconds_guarded = 0.0
    for example in examples:
        exact, _ = greedy(example, EXACT, off)
        plain, t = greedy(example, wanted, off)
        guarded, t_guarded = greedy(example, wanted, guard)
        same += same_positions(exact, plain)
        same_guarded += same_positions(exact, guarded)
        positions += min(len(exact), len(plain))
        tokens, tokens_guarded = tokens + len(plain), tokens_guarded + len(guarded)
        seconds, seconds_guarded = seconds + t, seconds_guarded + t_guarded
    return GuardFigures(
        policy.key,
        scorer,
        guard_threshold(guard),
        recompute,
        1 - same / max(positions, 1),
        1 - same_guarded / max(positions, 1),
        seconds / max(tokens, 1) * 1e3,
        seconds_guarded / max(tokens_guarded, 1) * 1e3,
        positions,
    )


EXACT = pb.RoutingPolicy(name="exact")


def policy_request(
    client: Client, target: str, policy_name: str, given: Mapping[str, float]
) -> tuple[pb.ModelInfo, RoutingPolicy, pb.RoutingPolicy]:
    """The router's model, the policy parsed against it (errors name the command's flags), and the policy as
    requests send it (forced: past the router's quality guard, which this measurement feeds)."""
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
    if "adaptive_k" in policy.rules:
        wanted.queue_slo_ms = 0  # measured at its floor, the narrowest it serves (its key leaves the SLO out)
    return info, policy, wanted


def _greedy(
    client: Client,
    target: str,
    example: Example,
    max_tokens: int,
    routing: pb.RoutingPolicy,
    consistency_guard: pb.ConsistencyGuard | None = None,
) -> tuple[list[int], float]:
    """``example``'s greedy tokens under ``routing`` (and the guard, when given), and the seconds they took."""
    started = time.perf_counter()
    try:
        chunks = list(
            client.generate(
                example.text,
                max_new_tokens=max_tokens,
                stop_at_eos=False,
                routing_policy=routing,
                domain=example.domain,
                consistency_guard=consistency_guard,
            )
        )
    except grpc.RpcError as err:
        raise ExpertMeshError(f"{target}: {err.code().name}: {err.details()}") from None
    return [t for c in chunks for t in c.token_ids], time.perf_counter() - started
