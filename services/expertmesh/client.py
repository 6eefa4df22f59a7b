"""Python clients of the expertmesh Inference API, sync and asyncio.

    from expertmesh.client import Client
    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_new_tokens=16):
            print(chunk.text, end="")

``generate`` yields ``Chunk``s (new token ids and text); the last one carries
the finish reason and token usage. ``AsyncClient`` has the same methods, with the
same keyword arguments, as coroutines / async iterators. Both dial TLS when
``tls`` (default: the ``EXPERTMESH_TLS_*`` environment) names a CA or a client
certificate. Errors are ``grpc.RpcError`` with the server's status code
(``INVALID_ARGUMENT`` naming the field, ``UNAVAILABLE`` when the router cannot
be reached, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Mapping, Sequence, TypedDict, Unpack

from expertmesh.config.settings import TlsConfig
from expertmesh.infra.security.tls import secure_or_insecure_channel
from expertmesh.v1 import inference_pb2 as pb
from expertmesh.v1 import inference_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str
    #: "length", "stop", "eos" or "context" on the last chunk, else None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: one per token of ``token_ids`` when the request asked (``logprobs``): its log-probability and the
    #: most likely tokens' ``TopLogprob``s
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    #: the choice it belongs to (0 unless the request asked for ``n`` > 1)
    index: int = 0
    #: with ``routing_trace``: one ``TokenRouting`` per token of ``token_ids`` (on the last chunk: the token
    #: that ended the choice, EOS or a stop token id, if one did), each with its ``LayerRouting`` per MoE
    #: layer: the experts chosen, their weights and the group that served each
    routing: list[pb.TokenRouting] = field(default_factory=list)


_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_CONTEXT: "context",
}


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of ``generate`` and ``generate_text``: one typed definition that type
    checkers hold every call to, and a name not here raises TypeError."""

    max_new_tokens: int | None  # unset: the server's default
    temperature: float  # 0 (the default) decodes greedily
    top_p: float | None
    top_k: int  # 0 (the default): every token
    seed: int | None
    stop: Sequence[str]  # stop sequences
    stop_at_eos: bool  # default True
    stop_token_ids: Sequence[int]  # token ids that end the completion as EOS does
    #: token id -> bias in [-100, 100], added to its logit (OpenAI's logit_bias)
    logit_bias: Mapping[int, float]
    min_tokens: int  # new tokens before EOS or a stop token id may end the completion
    repetition_penalty: float | None  # > 0; unset: 1 (none)
    frequency_penalty: float  # in [-2, 2], over the tokens generated (OpenAI's)
    presence_penalty: float  # in [-2, 2], over the tokens generated (OpenAI's)
    logprobs: int | None  # each new token's log-probability and this many most likely tokens' (0-20)
    #: the output must be JSON that validates against this schema (a dict, or its JSON text); ``{}``: any JSON object
    json_schema: Mapping | str | None
    regex: str | None  # the whole output must match this regular expression
    n: int | None  # choices (1-16): chunks name theirs (``Chunk.index``), each ends with its finish reason
    #: the consistency guard's scorer ("self", "embedding"; "" turns the server's default off), or a message
    consistency_guard: str | pb.ConsistencyGuard | None
    routing_trace: bool  # each new token's routing per MoE layer (``Chunk.routing``); bounded by the server
    request_id: str  # at most 128 printable ASCII characters; unset: the server picks one
    #: prefix-cache isolation: cached KV blocks are shared only with requests of the same salt (at most 256 chars)
    cache_salt: str
    #: a policy name (its default parameters) or a ``RoutingPolicy`` message; unset: the server's default
    routing_policy: str | pb.RoutingPolicy | None
    domain: str | None  # the query's domain; unset: classified when the policy needs one


class ScoreOptions(TypedDict, total=False):
    """The keyword arguments of ``score``."""

    raw_logits: bool  # raw logits instead of log-probabilities
    full_distribution: bool  # also the whole next-token distribution at each position
    routing_policy: str | pb.RoutingPolicy | None
    domain: str | None
    cache_salt: str


def generate_request(
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_at_eos: bool = True,
    stop_token_ids: Sequence[int] = (),
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    repetition_penalty: float | None = None,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logprobs: int | None = None,
    json_schema: Mapping | str | None = None,
    regex: str | None = None,
    n: int | None = None,
    consistency_guard: str | pb.ConsistencyGuard | None = None,
    routing_trace: bool = False,
    request_id: str = "",
    routing_policy: str | pb.RoutingPolicy | None = None,
    domain: str | None = None,
    cache_salt: str = "",
) -> pb.GenerateRequest:
    """The ``GenerateRequest`` of ``GenerateOptions``."""
    request = pb.GenerateRequest(
        stop=list(stop),
        stop_at_eos=stop_at_eos,
        stop_token_ids=list(stop_token_ids),
        request_id=request_id,
        routing_trace=routing_trace,
        cache_salt=cache_salt,
    )
    request.sampling.logit_bias.update(logit_bias or {})
    request.sampling.min_tokens = min_tokens
    request.sampling.frequency_penalty = frequency_penalty
    request.sampling.presence_penalty = presence_penalty
    if repetition_penalty is not None:
        request.sampling.repetition_penalty = repetition_penalty
    if logprobs is not None:
        request.logprobs = logprobs
    if json_schema is not None and regex is not None:
        raise ValueError("json_schema and regex both constrain the output: choose one")
    if isinstance(json_schema, Mapping) and not json_schema:
        request.structured_output.json_object = True
    elif json_schema is not None:
        schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        request.structured_output.json_schema = schema
    elif regex is not None:
        request.structured_output.regex = regex
    if n is not None:
        request.n = n
    if isinstance(consistency_guard, str):
        request.consistency_guard.scorer = consistency_guard
        request.consistency_guard.SetInParent()
    elif consistency_guard is not None:
        request.consistency_guard.CopyFrom(consistency_guard)
    _set_routing(request, routing_policy, domain)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    request.sampling.temperature = temperature
    request.sampling.top_k = top_k
    if top_p is not None:
        request.sampling.top_p = top_p
    if seed is not None:
        request.sampling.seed = seed
    return request


def _set_routing(
    request: pb.GenerateRequest | pb.ScoreRequest, routing_policy: str | pb.RoutingPolicy | None, domain: str | None
) -> None:
    if isinstance(routing_policy, str):
        request.routing_policy.name = routing_policy
    elif routing_policy is not None:
        request.routing_policy.CopyFrom(routing_policy)
    if domain is not None:
        request.domain = domain


def score_request(
    prompt: str | Sequence[int],
    *,
    raw_logits: bool = False,
    full_distribution: bool = False,
    routing_policy: str | pb.RoutingPolicy | None = None,
    domain: str | None = None,
    cache_salt: str = "",
) -> pb.ScoreRequest:
    """The ``ScoreRequest`` of ``ScoreOptions``."""
    request = pb.ScoreRequest(raw_logits=raw_logits, full_distribution=full_distribution, cache_salt=cache_salt)
    _set_routing(request, routing_policy, domain)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _chunk(response: pb.GenerateResponse) -> Chunk:
    if response.WhichOneof("event") == "finished":
        f = response.finished
        return Chunk(
            [],
            "",
            _REASONS.get(f.reason),
            f.usage.prompt_tokens,
            f.usage.completion_tokens,
            index=response.index,
            routing=list(f.routing),
        )
    return Chunk(
        list(response.delta.token_ids),
        response.delta.text,
        logprobs=list(response.delta.logprobs),
        index=response.index,
        routing=list(response.delta.routing),
    )


class Client:
    """The Inference API of one router, blocking; use as a context manager or call ``close``."""

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, tls: TlsConfig | None = None):
        self._channel = secure_or_insecure_channel(target, tls=tls)
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._timeout = timeout

    def generate(self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]) -> Iterator[Chunk]:
        """Stream a completion: ``Chunk``s of new tokens, the last with the finish reason and usage."""
        for response in self._stub.Generate(generate_request(prompt, **options), timeout=self._timeout):
            yield _chunk(response)

    def generate_text(self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]) -> str:
        """The whole completion's text."""
        return "".join(chunk.text for chunk in self.generate(prompt, **options))

    def score(self, prompt: str | Sequence[int], **options: Unpack[ScoreOptions]) -> pb.ScoreResponse:
        """Log-probabilities of the prompt's tokens (position i: log p(token_i | tokens_<i))."""
        return self._stub.Score(score_request(prompt, **options), timeout=self._timeout)

    def models(self) -> list[pb.ModelInfo]:
        return list(self._stub.ListModels(pb.ListModelsRequest(), timeout=self._timeout).models)

    def load_stats(self) -> str:
        """The router's expert load window as the stats JSON ``expertmesh plan`` reads (every page of it)."""
        pages, row = [], 0
        while True:
            response = self._stub.GetLoadStats(pb.LoadStatsRequest(first_row=row), timeout=self._timeout)
            pages.append(json.loads(response.stats_json))
            row = response.next_row
            if not row:
                return json.dumps(merge_stats_pages(pages))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """``Client`` for asyncio: the same methods and arguments, as coroutines / async iterators."""

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, tls: TlsConfig | None = None):
        self._channel = secure_or_insecure_channel(target, tls=tls, aio=True)
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._timeout = timeout

    async def generate(self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]) -> AsyncIterator[Chunk]:
        """Stream a completion: ``Chunk``s of new tokens, the last with the finish reason and usage."""
        async for response in self._stub.Generate(generate_request(prompt, **options), timeout=self._timeout):
            yield _chunk(response)

    async def generate_text(self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]) -> str:
        """The whole completion's text."""
        return "".join([chunk.text async for chunk in self.generate(prompt, **options)])

    async def score(self, prompt: str | Sequence[int], **options: Unpack[ScoreOptions]) -> pb.ScoreResponse:
        """Log-probabilities of the prompt's tokens (position i: log p(token_i | tokens_<i))."""
        return await self._stub.Score(score_request(prompt, **options), timeout=self._timeout)

    async def models(self) -> list[pb.ModelInfo]:
        return list((await self._stub.ListModels(pb.ListModelsRequest(), timeout=self._timeout)).models)

    async def load_stats(self) -> str:
        """The router's expert load window as the stats JSON ``expertmesh plan`` reads (every page of it)."""
        pages, row = [], 0
        while True:
            response = await self._stub.GetLoadStats(pb.LoadStatsRequest(first_row=row), timeout=self._timeout)
            pages.append(json.loads(response.stats_json))
            row = response.next_row
            if not row:
                return json.dumps(merge_stats_pages(pages))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def merge_stats_pages(pages: list[dict]) -> dict:
    """GetLoadStats pages (each the stats format for some rows, from "first_row"), in order -> the whole."""
    by_row = ("moe_layers", "load", "coactivation", "position_load", "relative_load")
    merged = {**pages[0], **{key: [] for key in by_row}, "domain_load": {}}
    merged.pop("first_row", None)
    for page in pages:
        for key in by_row:
            merged[key] += page.get(key, [])  # (relative_load: not from routers before it was counted)
        for domain, rows in page["domain_load"].items():
            merged["domain_load"].setdefault(domain, []).extend(rows)
    merged["num_layers"] = len(merged["moe_layers"])
    return merged
