"""A request's routing, decided before it reaches the engine: its policy (the request's or the server's
default), its domain (the client's, or the query classifier's when the policy needs one and none was
given), the per-layer biases its bias rule adds (from the domain's capability profile), and the quality
guard. Anything wrong is an ``InvalidRequest`` naming the field.

Profiles and quality records are read from the state store and kept for ``refresh_s`` seconds, so a
request costs no store round trip while `expertmesh profile build` can still change them under a
running router.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

import torch

from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest
from expertmesh.infra.telemetry.setup import tracer
from expertmesh.router.policy.profiles import DomainProfile, load_profiles, lookup
from expertmesh.router.policy.quality import PolicyQuality, guard_problem
from expertmesh.router.policy.routing_policy import (
    BIAS_RULES,
    DESCRIPTIONS,
    PARAMETER_NAMES,
    PolicyError,
    RequestRouting,
    RoutingPolicy,
    parameters,
    parse_policy,
    policy_names,
    prefer_bias,
    restrict_bias,
)
from expertmesh.serving.consistency_guard import GuardError, GuardSpec
from expertmesh.store import StateStore
from expertmesh.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

#: longest ``domain`` a request may name
MAX_DOMAIN_CHARS = 64
DOMAIN_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class RequestRouter:
    def __init__(
        self,
        top_k: int,
        num_experts: int,
        moe_layers: tuple[int, ...],
        default_policy: str,
        store: StateStore | None,
        kl_bound: float,
        classifier: Callable[[], object] | None = None,
        refresh_s: float = 5.0,
        guard_default: GuardSpec | None = None,
    ):
        """``classifier``: returns the query classifier (called on first need; default: the trained default).
        ``guard_default``: the consistency guard of non-exact requests that ask for none (None: off)."""
        self.top_k, self.num_experts, self.moe_layers = top_k, num_experts, tuple(moe_layers)
        try:
            self.default = parse_policy(default_policy, {}, top_k, num_experts, "routing_policy")
        except PolicyError as err:
            raise ExpertMeshError(
                f"the server's default routing policy (--routing-policy, EXPERTMESH_ROUTING_POLICY): {err}"
            ) from None
        self._store = store
        self._kl_bound = kl_bound
        self.guard_default = guard_default
        self._classifier_factory = classifier
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._profiles: dict[str, DomainProfile] = {}
        self._quality: dict[str, PolicyQuality] = {}

    def consistency_guard(
        self, message: pb.ConsistencyGuard | None, routing: RequestRouting | None
    ) -> GuardSpec | None:
        """The request's consistency guard (``message``: its ``consistency_guard``, None if unset; an empty
        scorer: off), else the server's default; None for exact routing, which the guard never touches."""
        if message is not None and message.scorer:
            try:
                spec = GuardSpec.parse(
                    message.scorer,
                    message.threshold if message.HasField("threshold") else None,
                    message.max_regenerations if message.HasField("max_regenerations") else None,
                    self.top_k,
                    recompute=message.recompute or "widened",
                )
            except GuardError as err:
                raise InvalidRequest(str(err)) from None
        elif message is not None:
            return None  # asked for none
        else:
            spec = self.guard_default
        return None if routing is None or routing.policy.is_exact else spec

    # -- what ListModels reports ------------------------------------------------------------

    def catalogue(self) -> list[pb.RoutingPolicyInfo]:
        params = parameters(self.top_k, self.num_experts)
        infos = []
        for name in policy_names():
            rules = [] if name == "exact" else name.split("+")
            infos.append(
                pb.RoutingPolicyInfo(
                    name=name,
                    description="; ".join(DESCRIPTIONS[r] for r in rules) or DESCRIPTIONS["exact"],
                    needs_domain=any(r in BIAS_RULES for r in rules),
                    parameters=[
                        pb.RoutingParameter(
                            name=p.name,
                            rule=p.rule,
                            default_value=p.default,
                            min=p.low,
                            max=p.high,
                            integer=p.integer,
                            description=p.description,
                        )
                        for p in params
                        if p.rule in rules
                    ],
                )
            )
        return infos

    # -- one request -------------------------------------------------------------------------

    def resolve(
        self, request: pb.GenerateRequest | pb.ScoreRequest, prompt_text: Callable[[], str | None]
    ) -> RequestRouting | None:
        """The routing of ``request`` (None: stock gate, no domain). ``prompt_text`` gives the prompt as
        text for the classifier (None when there is none)."""
        policy = self._policy(request)
        domain = request.domain if request.HasField("domain") else None
        if domain is not None:
            self._check_domain(domain)
        elif policy.needs_domain:
            domain = self._classify(policy, prompt_text())
        if not policy.is_exact and not request.routing_policy.force:
            problem = guard_problem(self._snapshot()[1].get(policy.key), self._kl_bound)
            if problem:
                raise InvalidRequest(f"routing_policy: {problem}")
        routing = RequestRouting(policy, domain, self._biases(policy, domain) if policy.needs_domain else {})
        return None if routing.is_plain else routing

    def _policy(self, request: pb.GenerateRequest | pb.ScoreRequest) -> RoutingPolicy:
        if not request.HasField("routing_policy"):
            return self.default
        message = request.routing_policy
        given = {p: float(getattr(message, p)) for p in PARAMETER_NAMES if message.HasField(p)}
        try:
            return parse_policy(message.name or self.default.name, given, self.top_k, self.num_experts)
        except PolicyError as err:
            raise InvalidRequest(str(err)) from None

    def _classifier(self):
        if self._classifier_factory is None:
            from expertmesh.classifier import default_classifier

            self._classifier_factory = default_classifier
        return self._classifier_factory()

    def _check_domain(self, domain: str) -> None:
        """A domain of the classifier's taxonomy, or one level below one, in at most MAX_DOMAIN_CHARS: the
        load windows and profiles keep one entry per domain, so clients must not be able to mint them."""
        known = sorted({d.split("/")[0] for d in self._classifier().domains})
        shown = repr(domain[:32]) + ("..." if len(domain) > 32 else "")
        if len(domain) > MAX_DOMAIN_CHARS:
            raise InvalidRequest(f"domain: {len(domain)} characters, at most {MAX_DOMAIN_CHARS} ({shown})")
        parts = domain.split("/")
        if len(parts) > 2 or parts[0] not in known or not all(DOMAIN_PART.fullmatch(p) for p in parts):
            raise InvalidRequest(
                f"domain: unknown domain {shown}; known: {', '.join(known)} "
                "(or a/b below one, b of letters, digits, '_', '-', '.')"
            )

    def _classify(self, policy: RoutingPolicy, text: str | None) -> str:
        if not text:
            raise InvalidRequest(
                f"domain: policy {policy.name} needs the query's domain; "
                "set domain (a token-id prompt cannot be classified)"
            )
        with tracer().start_as_current_span("classify") as span:
            result = self._classifier().classify(text)
            span.set_attributes(
                {
                    "expertmesh.domain": result.domain,
                    "expertmesh.confidence": float(result.confidence),
                    "expertmesh.classify_ms": result.seconds * 1e3,
                }
            )
        return result.domain

    def _biases(self, policy: RoutingPolicy, domain: str) -> dict[int, torch.Tensor]:
        # a miss re-reads at once: profiles just built need not wait for the next refresh
        profile = lookup(self._snapshot()[0], domain) or lookup(self._snapshot(force=True)[0], domain)
        if profile is None:
            raise InvalidRequest(
                f"domain: no capability profile for {domain!r} yet, which policy {policy.name} needs; "
                "build profiles with `expertmesh profile build`"
            )
        if profile.moe_layers != self.moe_layers or profile.share.shape[1] != self.num_experts:
            raise InvalidRequest(
                f"domain: the profile of {domain!r} was built on another model; "
                "rebuild it with `expertmesh profile build`"
            )
        biases = {}
        for layer in self.moe_layers:
            row = profile.row(layer)
            if "prefer" in policy.rules:
                biases[layer] = prefer_bias(torch.from_numpy(profile.lift[row]), policy.alpha)
            else:
                biases[layer] = restrict_bias(torch.from_numpy(profile.share[row]), policy.top_n)
        return biases

    def _snapshot(self, force: bool = False) -> tuple[dict[str, DomainProfile], dict[str, PolicyQuality]]:
        """Profiles and quality records, re-read from the store at most every ``refresh_s`` unless ``force``."""
        with self._lock:
            if self._store is not None and (force or time.monotonic() - self._read_at >= self._refresh_s):
                try:
                    self._profiles = load_profiles(self._store)
                    self._quality = {k: PolicyQuality.from_json(v) for k, v in self._store.policy_quality().items()}
                except ConnectionError as err:  # serve on what was read last; the store may be back soon
                    log.warning("cannot read profiles and policy records from the state store: %s", err)
                self._read_at = time.monotonic()
            return self._profiles, self._quality
