"""One request builder for both APIs: what a client asked for, in fields neither API owns (``RequestSpec``,
``ScoreSpec``), checked against every bound once and made into the engine's ``GenerationRequest``\\ s.

A refusal is an ``InvalidRequest`` whose ``field`` names the request field at fault as the asking API spells
it (``RequestSpec.names``): the gRPC API answers INVALID_ARGUMENT with its message, the HTTP API 400 with
``param`` set to that field. Nothing a bound refuses reaches the engine.

| what | bound |
| --- | --- |
| prompt | 1 token to the model's context - 1 (Score: the whole context), every id in the vocabulary |
| ``n`` | 1 to ``MAX_CHOICES`` (16) |
| ``max_new_tokens`` | 1 to the server's ``max_new_tokens_cap`` |
| ``min_tokens`` | at most ``max_new_tokens`` |
| ``logprobs`` (most likely tokens per position) | 0 to ``MAX_TOP_LOGPROBS`` (20) |
| ``stop`` | ``MAX_STOP_SEQUENCES`` (16) of 1 to ``MAX_STOP_BYTES`` (256) bytes of UTF-8 |
| ``stop_token_ids`` | ``MAX_STOP_TOKEN_IDS`` (64), in the vocabulary |
| ``logit_bias`` | ``MAX_LOGIT_BIAS_TOKENS`` (1024) ids in the vocabulary, each in [-100, 100] |
| a JSON schema or regex | ``MAX_GRAMMAR_BYTES`` (64 KiB) |
| ``request_id`` | ``MAX_REQUEST_ID_CHARS`` (128) printable ASCII characters |
| ``cache_salt`` | ``MAX_CACHE_SALT_CHARS`` (256) characters |
| ``routing_trace`` | max_new_tokens x n x MoE layers at most the server's ``max_routing_trace_entries`` |
| ``domain`` | ``MAX_DOMAIN_CHARS`` (64), a label of the classifier's taxonomy |
| Score's ``full_distribution`` | prompt tokens x vocabulary at most ``MAX_DISTRIBUTION_FLOATS`` (16 Mi floats) |
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from expertmesh.config.settings import ServingConfig
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.router.policy.routing_policy import RequestRouting, seeded
from expertmesh.serving.canary import CanaryTicket
from expertmesh.serving.grammar import CompiledGrammar, Grammars, GrammarSpec
from expertmesh.serving.request import GenerationRequest, ScoreSpec
from expertmesh.serving.request_routing import RequestRouter
from expertmesh.serving.routing_trace import trace_problem
from expertmesh.serving.sampling import (
    MAX_CHOICES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    choice_seed,
)
from expertmesh.serving.text_stream import stop_problems
from expertmesh.v1 import inference_pb2 as pb

__all__ = [
    "MAX_CACHE_SALT_CHARS",
    "MAX_DISTRIBUTION_FLOATS",
    "MAX_REQUEST_ID_CHARS",
    "ModelBounds",
    "RequestBuilder",
    "RequestSpec",
    "ScoreSpec",
    "ScoreRequestSpec",
]

#: the longest caller-chosen request id: it is echoed in every streamed message and log line
MAX_REQUEST_ID_CHARS = 128
#: the longest cache salt (it is hashed into every prefix-cache key of the request, never stored as given)
MAX_CACHE_SALT_CHARS = 256
#: floats of Score's full distribution at most (64 MiB of float32 on the wire)
MAX_DISTRIBUTION_FLOATS = 16 * 2**20


@dataclass(frozen=True)
class ModelBounds:
    """What the served model bounds a request by."""

    vocab_size: int
    max_context: int
    moe_layers: int


@dataclass(frozen=True)
class RequestSpec:
    """A generation as a client asked for it (``None``: the server's default). ``names`` maps the fields that
    the APIs spell differently (``prompt``, ``max_new_tokens``, ``logprobs``) to the asking API's names."""

    prompt_ids: tuple[int, ...]
    #: the prompt as the client sent it, when it was text (the query classifier reads it; else the ids decoded)
    prompt_text: str | None = None
    request_id: str = ""
    n: int = 1
    max_new_tokens: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True
    logprobs: int | None = None
    #: also the prompt's tokens' log-probabilities, with this many most likely each (an echo; first choice only)
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    routing_policy: pb.RoutingPolicy | None = None
    domain: str | None = None
    consistency_guard: pb.ConsistencyGuard | None = None
    routing_trace: bool = False
    cache_salt: str = ""
    #: time.monotonic() after which the request fails with DEADLINE_EXCEEDED
    deadline: float | None = None
    #: who asked (``RequestBuilder.client_key``): each client's fair share of sequence slots
    client: str = ""
    #: its key for a canary's arm (the client's canary key or OpenAI ``user``; "": its request id)
    canary_key: str = ""
    names: Mapping[str, str] = field(default_factory=dict)

    def name(self, what: str) -> str:
        return self.names.get(what, what)


@dataclass(frozen=True)
class ScoreRequestSpec:
    """A Score request as a client asked for it."""

    prompt_ids: tuple[int, ...]
    prompt_text: str | None = None
    score: ScoreSpec = ScoreSpec()
    routing_policy: pb.RoutingPolicy | None = None
    domain: str | None = None
    cache_salt: str = ""
    deadline: float | None = None
    client: str = ""


class RequestBuilder:
    def __init__(
        self,
        model: ModelBounds,
        config: ServingConfig,
        grammars: Grammars,
        routing: RequestRouter | None,
        decode: Callable[[tuple[int, ...]], str] | None,
    ):
        """``routing``: resolves routing policies and domains (None: a server that takes none). ``decode``: the
        tokenizer's decode, for the classifier of a token-id prompt (None: no tokenizer)."""
        self._model = model
        self._config = config
        self._grammars = grammars
        self._routing = routing
        self._decode = decode

    def build(self, spec: RequestSpec) -> list[GenerationRequest]:
        """The engine's request of each of ``spec``'s ``n`` choices: the same but for each one's id and seed (and
        the prompt's log-probabilities, which only the first reports). Raises InvalidRequest naming the field."""
        self._check_prompt(spec.prompt_ids, spec.name("prompt"), room_for_one=True)
        if not 1 <= spec.n <= MAX_CHOICES:
            raise _refused("n", f"n takes 1 to {MAX_CHOICES} choices, got {spec.n}")
        max_new = self._max_new_tokens(spec)
        request_id = self._request_id(spec.request_id)
        self._check_salt(spec.cache_salt)
        self._check_sampling(spec, max_new)
        self._check_stops(spec)
        for what, count in (("logprobs", spec.logprobs), ("logprobs", spec.prompt_logprobs)):
            if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
                name = spec.name(what)
                raise _refused(name, f"{name} takes 0 to {MAX_TOP_LOGPROBS} most likely tokens, got {count}")
        if spec.routing_trace:
            problem = trace_problem(max_new, spec.n, self._model.moe_layers, self._config.max_routing_trace_entries)
            if problem:
                raise _refused("routing_trace", problem)
        routing, canary = self._resolve(
            spec.routing_policy, spec.domain, spec.prompt_ids, spec.prompt_text, spec.canary_key or request_id
        )
        # noisy_topk's seed: the request's (every choice of it routes alike), else its id's hash
        routing = seeded(routing, spec.sampling.seed, request_id)
        guard = self._consistency_guard(spec.consistency_guard, routing)
        grammar = self._grammar(spec.grammar)
        base = GenerationRequest(
            request_id=request_id,
            prompt_ids=tuple(spec.prompt_ids),
            max_new_tokens=max_new,
            sampling=spec.sampling,
            stop=tuple(spec.stop),
            stop_at_eos=spec.stop_at_eos,
            stop_token_ids=tuple(spec.stop_token_ids),
            deadline=spec.deadline,
            routing=routing,
            logprobs=spec.logprobs,
            prompt_logprobs=spec.prompt_logprobs,
            grammar=grammar,
            consistency_guard=guard,
            routing_trace=spec.routing_trace,
            cache_salt=spec.cache_salt,
            client=spec.client,
            canary=canary,
        )
        if spec.n == 1:
            return [base]
        return [
            replace(
                base,
                request_id=f"{request_id}-{i}",
                sampling=replace(spec.sampling, seed=choice_seed(spec.sampling.seed, i)),
                prompt_logprobs=spec.prompt_logprobs if i == 0 else None,
            )
            for i in range(spec.n)
        ]

    def build_score(self, spec: ScoreRequestSpec) -> GenerationRequest:
        """The engine's request of a Score call (the prompt's logits, no new token)."""
        self._check_prompt(spec.prompt_ids, "prompt", room_for_one=False)
        self._check_salt(spec.cache_salt)
        if spec.score.full_distribution:
            floats = len(spec.prompt_ids) * self._model.vocab_size
            if floats > MAX_DISTRIBUTION_FLOATS:
                raise _refused(
                    "full_distribution",
                    f"full_distribution of {len(spec.prompt_ids)} tokens x a vocabulary of {self._model.vocab_size} "
                    f"is {floats} floats, above this server's cap of {MAX_DISTRIBUTION_FLOATS}; score a shorter "
                    "prompt, or ask for token scores only",
                )
        return GenerationRequest(
            request_id=uuid.uuid4().hex[:16],
            prompt_ids=tuple(spec.prompt_ids),
            deadline=spec.deadline,
            score=spec.score,
            routing=self._score_routing(spec),
            cache_salt=spec.cache_salt,
            client=spec.client,
        )

    # -- the bounds -----------------------------------------------------------------------

    def _check_prompt(self, ids: tuple[int, ...], name: str, room_for_one: bool) -> None:
        if not ids:
            raise _refused(name, f"{name} is empty: send text or token ids")
        vocab = self._model.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise _refused(name, f"{name}: token ids {bad[:5]} are outside the vocabulary (0-{vocab - 1})")
        context = self._model.max_context
        if room_for_one and len(ids) >= context:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; the model's context is {context} tokens, "
                "leaving no room for a new one",
                field=name,
                reason="context_length_exceeded",
            )
        if not room_for_one and len(ids) > context:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; the model's context is {context} tokens",
                field=name,
                reason="context_length_exceeded",
            )

    def _max_new_tokens(self, spec: RequestSpec) -> int:
        name, cap = spec.name("max_new_tokens"), self._config.max_new_tokens_cap
        if spec.max_new_tokens is None:
            return self._config.default_max_new_tokens
        if spec.max_new_tokens <= 0:
            raise _refused(name, f"{name} must be at least 1, got {spec.max_new_tokens}")
        if spec.max_new_tokens > cap:
            raise _refused(name, f"{name} {spec.max_new_tokens} is above this server's cap of {cap}")
        return spec.max_new_tokens

    @staticmethod
    def _request_id(given: str) -> str:
        if not given:
            return uuid.uuid4().hex[:16]
        if len(given) > MAX_REQUEST_ID_CHARS or not (given.isascii() and given.isprintable()):
            raise _refused(
                "request_id",
                f"request_id takes 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters, got {len(given)} "
                f"characters starting {given[:32]!r}",
            )
        return given

    @staticmethod
    def _check_salt(salt: str) -> None:
        if len(salt) > MAX_CACHE_SALT_CHARS:
            raise _refused("cache_salt", f"cache_salt takes at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")

    def _check_sampling(self, spec: RequestSpec, max_new: int) -> None:
        sampling = spec.sampling
        if sampling.min_tokens > max_new:
            raise _refused(
                "min_tokens", f"min_tokens {sampling.min_tokens} is more than {spec.name('max_new_tokens')} {max_new}"
            )
        problems = sampling.field_problems(self._model.vocab_size)
        if problems:
            raise _refused(problems[0][0], "; ".join(message for _, message in problems))

    def _check_stops(self, spec: RequestSpec) -> None:
        problems = stop_problems(spec.stop)
        if problems:
            raise _refused("stop", "; ".join(problems))
        if spec.stop and self._decode is None:
            raise _refused("stop", "stop sequences need the model's tokenizer, and this model has none")
        ids, vocab = spec.stop_token_ids, self._model.vocab_size
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise _refused("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise _refused("stop_token_ids", f"stop_token_ids {bad[:5]} are outside the vocabulary (0-{vocab - 1})")

    # -- what needs the router ------------------------------------------------------------------

    def _resolve(
        self,
        policy: pb.RoutingPolicy | None,
        domain: str | None,
        ids: tuple[int, ...],
        text: str | None,
        canary_key: str | None = None,
    ) -> tuple[RequestRouting | None, CanaryTicket | None]:
        """Its routing and canary ticket (``canary_key`` None: in no canary)."""
        if self._routing is None:
            if policy is not None or domain is not None:
                raise _refused("routing_policy", "this server takes no routing policies or domains")
            return None, None
        decode = self._decode
        return self._routing.route(
            policy, domain, lambda: text if text is not None else decode and decode(ids), canary_key
        )

    def _score_routing(self, spec: ScoreRequestSpec) -> RequestRouting | None:
        # a Score call has neither seed nor id: noisy_topk's seed is the hash of "" (the same for every call); in
        # no canary (it generates nothing to compare)
        routing, _ = self._resolve(spec.routing_policy, spec.domain, spec.prompt_ids, spec.prompt_text)
        return seeded(routing, None, "")

    def _consistency_guard(self, message: pb.ConsistencyGuard | None, routing: RequestRouting | None):
        if self._routing is None:
            if message is not None and message.scorer:
                raise _refused("consistency_guard", "this server takes no consistency guard")
            return None
        return self._routing.consistency_guard(message, routing)

    def _grammar(self, spec: GrammarSpec | None) -> CompiledGrammar | None:
        return self._grammars.compile(spec) if spec is not None else None


def _refused(name: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, field=name)
