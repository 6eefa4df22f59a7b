"""Between OpenAI's shapes and the engine.

A completion or chat request becomes the request builder's ``RequestSpec``, and
the builder the gRPC API uses checks it against the model and the server's
limits, so both refuse the same request for the same reason. The engine's
finish reasons become OpenAI's ("eos" and "stop" are "stop"; "context" is
"length"), and ``CompletionShapes`` / ``ChatShapes`` build each endpoint's
whole response and stream chunks from the same few facts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from expertmesh.config.settings import ServingConfig
from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest
from expertmesh.serving.chat import chat_prompt_ids
from expertmesh.serving.engine import Engine
from expertmesh.serving.events import FinishEvent, TokenLogprob
from expertmesh.serving.openai_errors import ApiError
from expertmesh.serving.openai_responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    ChoiceRoutingTrace,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    LayerRoutingBody,
    ModelCard,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenRoutingBody,
    Usage,
)
from expertmesh.serving.openai_schema import (
    ChatCompletionRequest,
    FinishReason,
    GenerationFields,
    Prompt,
    ToolCall,
    ToolCallFunction,
)
from expertmesh.serving.request import GenerationRequest, Request
from expertmesh.serving.request_builder import ModelBounds, RequestBuilder, RequestSpec
from expertmesh.serving.request_routing import RequestRouter
from expertmesh.serving.routing_trace import TokenRouting
from expertmesh.serving.sampling import SamplingParams
from expertmesh.serving.tool_calls import auto_calls, may_be_a_call, named_calls, required_calls
from expertmesh.v1 import inference_pb2 as pb

_FINISH: dict[str, FinishReason] = {"length": "length", "context": "length", "stop": "stop", "eos": "stop"}

# OpenAI's defaults where a request leaves a sampling field out or null
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


def finish_reason(engine_reason: str) -> FinishReason:
    return _FINISH[engine_reason]


def usage(events: Sequence[FinishEvent]) -> Usage:
    """A request's usage from its choices' finish events: the prompt once (the choices share it), every
    choice's completion tokens."""
    prompt = events[0].prompt_tokens
    completion = sum(e.completion_tokens for e in events)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass(frozen=True)
class ServedModel:
    """The one model a router serves, as ``/v1/models`` lists it."""

    name: str
    vocab_size: int
    max_context: int
    #: MoE layers of the model (what a routing trace's size is counted in)
    moe_layers: int = 0
    #: unix seconds this server started serving it (OpenAI's ``created`` of a model)
    created: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> ModelCard:
        return ModelCard(id=self.name, created=self.created, max_model_len=self.max_context)


class OpenAIAdapter:
    def __init__(
        self, engine: Engine, tokenizer, model: ServedModel, config: ServingConfig, routing: RequestRouter | None = None
    ):
        """``routing``: the gRPC API's resolver of routing policies and domains (None: requests may ask
        for none)."""
        self._engine = engine
        self._tokenizer = tokenizer
        self.model = model
        self._config = config
        #: every bound of a request, as the gRPC API applies them
        self.builder = RequestBuilder(
            ModelBounds(model.vocab_size, model.max_context, model.moe_layers),
            config,
            engine.grammars,
            routing,
            tokenizer.decode if tokenizer is not None else None,
        )

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist here; this server serves {self.model.name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    # -- prompts -----------------------------------------------------------------------

    def completion_prompt(self, prompt: Prompt) -> list[int]:
        if prompt.text is not None:
            if self._tokenizer is None:
                raise ApiError.bad_request(
                    "this model has no tokenizer; send the prompt as a list of token ids", param="prompt"
                )
            return list(self._tokenizer(prompt.text)["input_ids"])
        return list(prompt.token_ids or [])

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The chat template's ids for the messages, and the tools unless ``tool_choice`` is "none"."""
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] if body.tool_mode != "none" else None
        return chat_prompt_ids(self._tokenizer, body.messages, self.model.name, tools=tools)

    # -- the tokenizer routes ------------------------------------------------------------

    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """vLLM's ``/tokenize``: the ids the generation routes would feed for this prompt or these messages."""
        if body.model is not None:
            self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = chat_prompt_ids(self._tokenizer, body.messages, self.model.name, body.add_generation_prompt)
        else:
            ids = list(
                self._require_tokenizer("prompt")(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
            )
        strs = self._tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.model.max_context, tokens=ids, token_strs=strs)

    def token_text(self, token_id: int) -> str:
        """A token as the log-probabilities name it: its text, or ``token_id:N`` without a tokenizer."""
        if self._tokenizer is None:
            return _token_id_text(token_id)
        return self._tokenizer.decode([token_id])

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's ``/detokenize``: the text of these token ids."""
        if body.model is not None:
            self.check_model(body.model)
        tokenizer = self._require_tokenizer("tokens")
        bad = [i for i in body.tokens if i >= self.model.vocab_size]
        if bad:
            raise ApiError.bad_request(
                f"token ids {bad[:5]} are outside the vocabulary (0-{self.model.vocab_size - 1})", param="tokens"
            )
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    def _require_tokenizer(self, param: str):
        if self._tokenizer is None:
            raise ApiError.bad_request("this model has no tokenizer; its prompts are token ids already", param=param)
        return self._tokenizer

    # -- generation ----------------------------------------------------------------------

    def generation_requests(
        self,
        body: GenerationFields,
        prompt_ids: list[int],
        request_id: str,
        routing_trace: bool,
        client: str,
        canary_key: str = "",
    ) -> list[GenerationRequest]:
        """The engine's request of each of the body's ``n`` choices, built and bounded by the request builder the
        gRPC API uses (a refusal is a 400 naming the field as this body spells it). ``routing_trace``: the
        body's or the header's ask for one. ``canary_key``: the header's (else the body's ``user``). Blocking (the
        tokenizer, the classifier, the grammar compiler): called off the event loop."""
        routing_policy = None
        if body.routing_policy is not None:
            routing_policy = pb.RoutingPolicy(**body.routing_policy.model_dump(exclude_none=True))
        guard = None
        if body.consistency_guard is not None:
            guard = pb.ConsistencyGuard(**body.consistency_guard.model_dump(exclude_none=True))
        try:
            spec = RequestSpec(
                prompt_ids=tuple(prompt_ids),
                request_id=request_id,
                n=body.choices,
                max_new_tokens=body.max_new_tokens,
                sampling=SamplingParams(
                    temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                    top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
                    top_k=body.top_k or 0,
                    seed=body.seed,
                    logit_bias=body.token_biases,
                    min_tokens=body.min_tokens or 0,
                    repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                    frequency_penalty=body.frequency_penalty or 0.0,
                    presence_penalty=body.presence_penalty or 0.0,
                ),
                stop=tuple(body.stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                stop_at_eos=not body.ignore_eos,
                logprobs=body.logprob_count,
                # an echo with logprobs: the prompt's from the same prefill (the first choice's; the others share it)
                prompt_logprobs=body.logprob_count if body.echoes else None,
                grammar=body.grammar_spec(),
                routing_policy=routing_policy,
                domain=body.domain,
                consistency_guard=guard,
                routing_trace=routing_trace,
                cache_salt=body.cache_salt or "",
                client=client,
                canary_key=canary_key or body.user or "",
                names=body.field_names,
            )
            return self.builder.build(spec)
        except InvalidRequest as err:
            raise ApiError.bad_request(str(err), param=err.field, code=err.reason) from None

    def echo_text(self, body: GenerationFields, prompt_ids: list[int]) -> str:
        """The prompt as an echoing completion returns it: the text sent, or its token ids decoded."""
        prompt = getattr(body, "prompt", None)
        if prompt is not None and prompt.text is not None:
            return prompt.text
        return self._tokenizer.decode(prompt_ids) if self._tokenizer is not None else ""

    def submit(self, request: GenerationRequest) -> Request:
        """The engine's sequence; a full or draining engine is a 429 or 503."""
        try:
            return self._engine.submit(request)
        except ExpertMeshError as err:
            raise ApiError.from_grpc(err.code, str(err)) from None


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# -- response shapes ---------------------------------------------------------------------


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"  # vLLM's name of a token when there is no tokenizer to read it


@dataclass(frozen=True)
class ChoiceResult:
    """One choice's whole answer: its text, the engine's finish reason, its tokens' log-probabilities and
    routing (when asked for)."""

    text: str
    reason: str
    logprobs: Sequence[TokenLogprob] = ()
    routing: Sequence[TokenRouting] = ()


def routing_body(tokens: Sequence[TokenRouting]) -> list[TokenRoutingBody]:
    """The engine's routing of some tokens, in the HTTP API's shape."""
    return [
        TokenRoutingBody(
            token_id=t.token_id,
            index=t.index,
            layers=[
                LayerRoutingBody(layer=r.layer, experts=list(r.experts), weights=list(r.weights), groups=list(r.groups))
                for r in t.layers
            ],
        )
        for t in tokens
    ]


def whole_trace(results: Sequence[ChoiceResult], traced: bool) -> list[ChoiceRoutingTrace] | None:
    """A whole response's ``routing_trace``: each choice's, by index (None: not asked for)."""
    if not traced:
        return None
    return [ChoiceRoutingTrace(index=i, tokens=routing_body(r.routing)) for i, r in enumerate(results)]


def with_routing(chunks: list, index: int, tokens: Sequence[TokenRouting], empty) -> list:
    """Stream chunks carrying choice ``index``'s routing of ``tokens``: on the first of ``chunks``, or on a chunk
    of its own (``empty``: a chunk without choices) when none goes out now (text held back for tool calls)."""
    if not tokens:
        return chunks
    trace = [ChoiceRoutingTrace(index=index, tokens=routing_body(tokens))]
    if not chunks:
        return [empty.model_copy(update={"routing_trace": trace})]
    return [chunks[0].model_copy(update={"routing_trace": trace}), *chunks[1:]]


@dataclass
class CompletionShapes:
    """``/v1/completions``: one ``text_completion`` object, whole or per chunk. ``token_text`` names a token in
    the log-probabilities."""

    id: str
    model: str
    token_text: Callable[[int], str] = _token_id_text
    created: int = field(default_factory=lambda: int(time.time()))
    #: per choice: characters of its text before its next token, for ``text_offset``
    _offsets: dict[int, int] = field(default_factory=dict)

    def _of(self, choices: list[CompletionChoice], used: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=used)

    def _logprobs(self, index: int, logprobs: Sequence[TokenLogprob]) -> CompletionLogprobs | None:
        if not logprobs:
            return None
        tokens = [self.token_text(t.token_id) for t in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[t.logprob for t in logprobs],
            top_logprobs=[
                {self.token_text(i): lp for i, lp in t.top} if t.logprob is not None else None for t in logprobs
            ],
            text_offset=offsets,
        )

    def whole(self, results: Sequence[ChoiceResult], used: Usage, traced: bool = False) -> Completion:
        completion = self._of(
            [
                CompletionChoice(
                    index=i, text=r.text, logprobs=self._logprobs(i, r.logprobs), finish_reason=finish_reason(r.reason)
                )
                for i, r in enumerate(results)
            ],
            used,
        )
        completion.routing_trace = whole_trace(results, traced)
        return completion

    def routed(self, chunks: list[Completion], index: int, tokens: Sequence[TokenRouting]) -> list[Completion]:
        """``chunks`` with choice ``index``'s routing of ``tokens`` (``with_routing``)."""
        return with_routing(chunks, index, tokens, self._of([]))

    def opening(self, choices: int) -> list[Completion]:
        return []

    def delta(self, index: int, text: str, logprobs: Sequence[TokenLogprob] = ()) -> list[Completion]:
        return [self._of([CompletionChoice(index=index, text=text, logprobs=self._logprobs(index, logprobs))])]

    def closing(self, index: int, reason: str) -> list[Completion]:
        return [self._of([CompletionChoice(index=index, text="", finish_reason=finish_reason(reason))])]

    def usage_only(self, used: Usage) -> Completion:
        return self._of([], used)


@dataclass(frozen=True)
class ToolReading:
    """How a chat answer's text becomes tool calls, by the request's ``tool_mode`` (``serving.tool_calls``)."""

    mode: Literal["auto", "required", "named"]
    names: tuple[str, ...]
    named: str | None = None

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolReading | None:
        """None: the answer is content only."""
        mode = body.tool_mode
        if mode == "none":
            return None
        named = body.tool_choice.function.name if mode == "named" else None
        return cls(mode, tuple(t.function.name for t in body.tools or ()), named)

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]] | None:
        """(content beside them, the calls) of an answer, or None when it calls nothing."""
        if self.mode == "named":
            found = named_calls(text, self.named)
            read = (None, found) if found else None
        elif self.mode == "required":
            found = required_calls(text)
            read = (None, found) if found else None
        else:
            read = auto_calls(text, self.names)
        if read is None:
            return None
        content, calls = read
        return content or None, [
            ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments)) for c in calls
        ]

    def holds(self, text: str) -> bool:
        """Whether a streamed answer's text so far is held back: a forced call always is (it is streamed whole, as
        one tool_calls delta, at its end); under "auto", while it may still be a call."""
        return self.mode != "auto" or may_be_a_call(text)


@dataclass
class ChatShapes:
    """``/v1/chat/completions``: a ``chat.completion``, or ``chat.completion.chunk``s that open with the role.
    ``tools``: how answers become tool calls (None: content only)."""

    id: str
    model: str
    token_text: Callable[[int], str] = _token_id_text
    tools: ToolReading | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    #: per choice whose stream may still be tool calls: its text and log-probabilities held back so far
    _held: dict[int, tuple[str, list[TokenLogprob]]] = field(default_factory=dict)
    #: the choices whose stream is known to be content
    _content: set[int] = field(default_factory=set)

    def _chunk(self, choices: list[ChatChunkChoice], used: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=used)

    def _top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        token = self.token_text(token_id)
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if not logprobs:
            return None
        content = []
        for t in logprobs:
            top = self._top(t.token_id, t.logprob)
            content.append(ChatTokenLogprob(**top.model_dump(), top_logprobs=[self._top(i, lp) for i, lp in t.top]))
        return ChatLogprobs(content=content)

    def _message(self, text: str, reason: str) -> tuple[AssistantMessage, FinishReason]:
        read = self.tools.calls(text) if self.tools is not None else None
        if read is None:
            return AssistantMessage(content=text), finish_reason(reason)
        content, calls = read
        return AssistantMessage(content=content, tool_calls=calls), "tool_calls"

    def whole(self, results: Sequence[ChoiceResult], used: Usage, traced: bool = False) -> ChatCompletion:
        choices = []
        for i, r in enumerate(results):
            message, reason = self._message(r.text, r.reason)
            choices.append(
                ChatChoice(index=i, message=message, logprobs=self._logprobs(r.logprobs), finish_reason=reason)
            )
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=used,
            routing_trace=whole_trace(results, traced),
        )

    def routed(
        self, chunks: list[ChatCompletionChunk], index: int, tokens: Sequence[TokenRouting]
    ) -> list[ChatCompletionChunk]:
        """``chunks`` with choice ``index``'s routing of ``tokens`` (``with_routing``)."""
        return with_routing(chunks, index, tokens, self._chunk([]))

    def opening(self, choices: int) -> list[ChatCompletionChunk]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(choices)
        ]

    def delta(self, index: int, text: str, logprobs: Sequence[TokenLogprob] = ()) -> list[ChatCompletionChunk]:
        if self.tools is not None and index not in self._content:
            held_text, held_logprobs = self._held.pop(index, ("", []))
            text, logprobs = held_text + text, [*held_logprobs, *logprobs]
            if self.tools.holds(text):
                self._held[index] = (text, logprobs)
                return []
            self._content.add(index)
        return [
            self._chunk(
                [ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=self._logprobs(logprobs))]
            )
        ]

    def closing(self, index: int, reason: str) -> list[ChatCompletionChunk]:
        out, finish = [], finish_reason(reason)
        if index in self._held:  # the whole answer was held: now it is known what it is
            text, logprobs = self._held.pop(index)
            message, finish = self._message(text, reason)
            calls = [DeltaToolCall(index=j, **call.model_dump()) for j, call in enumerate(message.tool_calls or ())]
            delta = ChatDelta(content=message.content, tool_calls=calls or None)
            out.append(self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(logprobs))]))
        return [*out, self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish)])]

    def usage_only(self, used: Usage) -> ChatCompletionChunk:
        return self._chunk([], used)


Shapes = CompletionShapes | ChatShapes
