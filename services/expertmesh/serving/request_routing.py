"""A request's routing, decided before it reaches the engine: its policy (the request's, else its domain's
default, else the server's: each configured with its parameters, ``routing_policy.parse_policy_spec``), its
domain (the client's, or the query classifier's when the policy needs one, or when per-domain defaults are
set and the request names neither), the per-layer biases its bias rule adds (from the domain's capability
profile), the quality guard, and its canary arm (``serving.canary``: a request that takes the server's default may
take a canary's candidate in its place). Anything wrong is an ``InvalidRequest`` naming the field.

Profiles and quality records are read from the state store by a thread of their own (``PolicyRecords``)
every ``refresh_s`` seconds, never on a request's thread or under a lock a request takes: a request costs
no store round trip, a store that does not answer (refused, or frozen until the socket times out) costs
only that thread its wait, and `expertmesh profile build` can still change them under a running router (a
request that names a domain with no profile yet asks for a read at once and waits for it, boundedly).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable, Mapping

import torch

from expertmesh.contracts.errors import CanaryRefused, ExpertMeshError, InvalidRequest
from expertmesh.infra.telemetry.setup import tracer
from expertmesh.router.policy.canary import CanaryError, CanaryState, canary_spec
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
    parse_policy_spec,
    policy_names,
    prefer_bias,
    restrict_bias,
)
from expertmesh.serving.canary import CanaryControl, CanaryStatus, CanaryTicket
from expertmesh.serving.consistency_guard import GuardError, GuardSpec
from expertmesh.store import StateStore
from expertmesh.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

#: longest ``domain`` a request may name
MAX_DOMAIN_CHARS = 64
DOMAIN_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class PolicyRecords:
    """Capability profiles and policy-quality records as the state store last gave them (see the module). A
    read runs on a thread of its own, one at a time, started when a request finds the last one older than
    ``refresh_s`` (or asks for a fresher one); no thread lives between reads."""

    def __init__(self, store: StateStore, refresh_s: float, wait_s: float = 1.0):
        """``wait_s``: the longest a request waits for a read it asked for (``fresher``) or for the first one."""
        self._store = store
        self._refresh_s = refresh_s
        self._wait_s = wait_s
        #: guards the fields below; never held over a store read
        self._cond = threading.Condition()
        self._profiles: dict[str, DomainProfile] = {}
        self._quality: dict[str, PolicyQuality] = {}
        self._started = self._done = 0  # reads begun and ended (answered or not)
        self._read_at = -float("inf")  # time.monotonic() the last read began
        self._reading = self._again = False
        self._failing = False

    def current(self) -> tuple[dict[str, DomainProfile], dict[str, PolicyQuality]]:
        """The last read (waiting up to ``wait_s`` for the first one); a stale one starts a read meanwhile."""
        with self._cond:
            if time.monotonic() - self._read_at >= self._refresh_s:
                self._read_later()
            self._cond.wait_for(lambda: self._done > 0, self._wait_s)
            return self._profiles, self._quality

    def fresher(self) -> tuple[dict[str, DomainProfile], dict[str, PolicyQuality]]:
        """A read begun after this call (waiting up to ``wait_s`` for it; else the last read)."""
        with self._cond:
            wanted = self._started + 1
            self._read_later()
            self._cond.wait_for(lambda: self._done >= wanted, self._wait_s)
            return self._profiles, self._quality

    def _read_later(self) -> None:
        """(Under ``_cond``) a read begins after this: now, or right after the one running."""
        if self._reading:
            self._again = True
            return
        self._reading = True
        threading.Thread(target=self._read, name="expertmesh-policy-records", daemon=True).start()

    def _read(self) -> None:
        while True:
            with self._cond:
                self._started += 1
                self._again = False
                self._read_at = time.monotonic()
            try:
                profiles = load_profiles(self._store)
                quality = {k: PolicyQuality.from_json(v) for k, v in self._store.policy_quality().items()}
            except ConnectionError as err:  # served on the last read meanwhile; the store may be back soon
                if not self._failing:
                    log.warning("cannot read profiles and policy records from the state store: %s", err)
                self._failing = True
                read = None
            else:
                if self._failing:
                    log.info("profiles and policy records read from the state store again")
                self._failing = False
                read = profiles, quality
            with self._cond:
                if read is not None:
                    self._profiles, self._quality = read
                self._done += 1
                self._cond.notify_all()
                if not self._again:
                    self._reading = False
                    return


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
        domain_policies: Mapping[str, str] | None = None,
    ):
        """``default_policy``: the policy of requests that name none, as ``parse_policy_spec`` reads it
        (``delta_gap(delta=0.2)``). ``domain_policies``: domain -> the same, in its place for that domain's
        requests (and the domains below it). ``classifier``: returns the query classifier (called on first need;
        default: the trained default). ``guard_default``: the consistency guard of non-exact requests that ask for
        none (None: off)."""
        self.top_k, self.num_experts, self.moe_layers = top_k, num_experts, tuple(moe_layers)
        self.default = self._configured(default_policy, "--routing-policy, EXPERTMESH_ROUTING_POLICY")
        self._kl_bound = kl_bound
        self.guard_default = guard_default
        self._classifier_factory = classifier
        where = "--domain-routing-policies, EXPERTMESH_DOMAIN_ROUTING_POLICIES"
        #: domain -> its requests' default policy (in place of ``default``)
        self.domain_defaults: dict[str, RoutingPolicy] = {}
        for domain, spec in (domain_policies or {}).items():
            try:
                self._check_domain(domain)
            except InvalidRequest as err:
                raise ExpertMeshError(f"the per-domain routing policies ({where}): {err}") from None
            self.domain_defaults[domain] = self._configured(spec, f"{where}: domain {domain!r}")
        #: None without a store: no profiles, no quality records
        self._records = PolicyRecords(store, refresh_s) if store is not None else None
        #: the canary of the server's default policy (none until the RouterAdmin API starts one)
        self.canary = CanaryControl()

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
                raise InvalidRequest(str(err), field=err.field) from None
        elif message is not None:
            return None  # asked for none
        else:
            spec = self.guard_default
        return None if routing is None or routing.policy.is_exact else spec

    def _configured(self, spec: str, where: str) -> RoutingPolicy:
        """A configured default policy, or an ExpertMeshError at start naming the setting (``where``)."""
        try:
            return parse_policy_spec(spec, self.top_k, self.num_experts, "routing_policy")
        except PolicyError as err:
            raise ExpertMeshError(f"the server's default routing policy ({where}): {err}") from None

    def default_for(self, domain: str | None) -> RoutingPolicy:
        """The default policy of a request of ``domain``: its own, else its top level's
        (``legal/contract`` -> ``legal``), else the server's."""
        if domain is None:
            return self.default
        return self.domain_defaults.get(domain) or self.domain_defaults.get(domain.split("/")[0]) or self.default

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
                            rule=p.rule_in(rules),
                            default_value=p.default,
                            min=p.low,
                            max=p.high,
                            integer=p.integer,
                            description=p.description,
                        )
                        for p in params
                        if p.rule_in(rules) is not None
                    ],
                )
            )
        return infos

    # -- one request -------------------------------------------------------------------------

    def resolve(
        self, message: pb.RoutingPolicy | None, domain: str | None, prompt_text: Callable[[], str | None]
    ) -> RequestRouting | None:
        """The routing of a request that asked for policy ``message`` and ``domain`` (None: the server's
        default policy; classified when the policy needs a domain), or None: stock gate, no domain.
        ``prompt_text`` gives the prompt as text for the classifier (None when there is none). In no canary."""
        return self.route(message, domain, prompt_text, None)[0]

    def route(
        self,
        message: pb.RoutingPolicy | None,
        domain: str | None,
        prompt_text: Callable[[], str | None],
        canary_key: str | None,
    ) -> tuple[RequestRouting | None, CanaryTicket | None]:
        """``resolve``'s routing, and the request's canary ticket: with ``canary_key`` (None: in no canary), a
        request that takes the server's default (no policy of its own, no domain default) is in the running
        canary's arm of that key, and in the candidate arm takes the candidate in place of the default."""
        if domain is not None:
            self._check_domain(domain)
        elif self.domain_defaults and (message is None or not message.name):
            text = prompt_text()  # its domain chooses its default policy (a token-id prompt: the server's)
            domain = self._classify(self.default, text) if text else None
        default, ticket, candidate = self.default_for(domain), None, None
        if canary_key is not None and default is self.default:
            candidate, ticket = self.canary.assign(canary_key, explicit=_names_policy(message))
        policy = candidate or self._policy(message, default)
        if domain is None and policy.needs_domain:
            domain = self._classify(policy, prompt_text())
        # a candidate's record was checked when its canary started
        if candidate is None and not policy.is_exact and not (message is not None and message.force):
            problem = guard_problem(self._quality().get(policy.key), self._kl_bound)
            if problem:
                raise InvalidRequest(f"routing_policy: {problem}", field="routing_policy")
        routing = RequestRouting(policy, domain, self._biases(policy, domain) if policy.needs_domain else {})
        return (None if routing.is_plain else routing), ticket

    def _policy(
        self, message: pb.RoutingPolicy | None, default: RoutingPolicy, field_prefix: str = "routing_policy"
    ) -> RoutingPolicy:
        """The request's policy: ``message`` (None: ``default``); one without a name is ``default`` with the
        parameters it sets in place of the configured ones."""
        if message is None:
            return default
        given = {p: float(getattr(message, p)) for p in PARAMETER_NAMES if message.HasField(p)}
        if not message.name:
            given = {**default.active(), **given}
        try:
            return parse_policy(message.name or default.name, given, self.top_k, self.num_experts, field_prefix)
        except PolicyError as err:
            raise InvalidRequest(str(err), field=err.field) from None

    # -- the canary (the RouterAdmin API) --------------------------------------------------------

    def start_canary(
        self,
        candidate: pb.RoutingPolicy,
        share: float,
        min_agreement: float | None = None,
        min_samples: int | None = None,
        sample_every: int | None = None,
    ) -> CanaryStatus:
        """Start a canary of ``candidate`` (checked as a request's policy is, its recorded quality too unless it
        says ``force``) against the server's default now; InvalidRequest naming the setting, CanaryRefused while
        one runs."""
        if not candidate.name:
            raise InvalidRequest("candidate.name: name the candidate policy, e.g. delta_gap", field="candidate.name")
        policy = self._policy(candidate, self.default, "candidate")
        try:
            spec = canary_spec(policy, share, min_agreement, min_samples, sample_every)
        except CanaryError as err:
            raise InvalidRequest(str(err), field=err.field) from None
        if not candidate.force:
            problem = guard_problem(self._quality().get(policy.key), self._kl_bound)
            if problem:
                raise InvalidRequest(f"candidate: {problem} (force starts it anyway)", field="candidate")
        started = self.canary.start(spec, self.default)
        if started.spec is not spec:
            raise CanaryRefused(f"a canary of {started.spec.candidate.spec} is running; promote or stop it first")
        return started

    def end_canary(self, promote: bool) -> CanaryStatus:
        """Promote the running canary (its candidate becomes the server's default) or stop it; CanaryRefused
        when none runs."""
        status = self.canary.running()
        if status is None:
            raise CanaryRefused(f"no canary is running (state: {_state_name(self.canary.status().state)})")
        if promote:
            reason = f"{status.spec.candidate.spec} is the server's default routing policy (was {self.default.spec})"
            ended = self.canary.end(CanaryState.PROMOTED, reason)
            if ended is not None:
                self.default = status.spec.candidate
        else:
            ended = self.canary.end(CanaryState.STOPPED, "stopped by an operator")
        if ended is None:  # it ended meanwhile (auto-stopped)
            raise CanaryRefused(f"no canary is running (state: {_state_name(self.canary.status().state)})")
        return ended

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
            raise InvalidRequest(
                f"domain: {len(domain)} characters, at most {MAX_DOMAIN_CHARS} ({shown})", field="domain"
            )
        parts = domain.split("/")
        if len(parts) > 2 or parts[0] not in known or not all(DOMAIN_PART.fullmatch(p) for p in parts):
            raise InvalidRequest(
                f"domain: unknown domain {shown}; known: {', '.join(known)} "
                "(or a/b below one, b of letters, digits, '_', '-', '.')",
                field="domain",
            )

    def _classify(self, policy: RoutingPolicy, text: str | None) -> str:
        if not text:
            raise InvalidRequest(
                f"domain: policy {policy.name} needs the query's domain; "
                "set domain (a token-id prompt cannot be classified)",
                field="domain",
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
        records = self._records
        # a miss asks for a read at once: profiles just built need not wait for the next refresh
        profile = records is not None and (lookup(records.current()[0], domain) or lookup(records.fresher()[0], domain))
        if not profile:
            raise InvalidRequest(
                f"domain: no capability profile for {domain!r} yet, which policy {policy.name} needs; "
                "build profiles with `expertmesh profile build`",
                field="domain",
            )
        if profile.moe_layers != self.moe_layers or profile.share.shape[1] != self.num_experts:
            raise InvalidRequest(
                f"domain: the profile of {domain!r} was built on another model; "
                "rebuild it with `expertmesh profile build`",
                field="domain",
            )
        biases = {}
        for layer in self.moe_layers:
            row = profile.row(layer)
            if "prefer" in policy.rules:
                biases[layer] = prefer_bias(torch.from_numpy(profile.lift[row]), policy.alpha)
            else:
                biases[layer] = restrict_bias(torch.from_numpy(profile.share[row]), policy.top_n)
        return biases

    def _quality(self) -> dict[str, PolicyQuality]:
        return self._records.current()[1] if self._records is not None else {}


def _names_policy(message: pb.RoutingPolicy | None) -> bool:
    """Whether a request's ``routing_policy`` is its own: a name, or parameters in place of the default's."""
    return message is not None and (bool(message.name) or any(message.HasField(p) for p in PARAMETER_NAMES))


def _state_name(state: CanaryState | None) -> str:
    return state.value if state is not None else "none started"
