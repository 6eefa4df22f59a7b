"""The OpenAI wire shapes of the HTTP API's answers (``/v1/completions``, ``/v1/chat/completions`` whole and
streamed, ``/v1/models``, vLLM's ``/tokenize`` and ``/detokenize``, the error body), as pydantic models; the
requests' are ``openai_schema``'s. Shapes are left as OpenAI has them, with ``null`` where a field does not
apply: SDKs parse them with their own models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from expertmesh.serving.openai_schema import ChatMessage, FinishReason, ToolCall

# -- responses ----------------------------------------------------------------------------


class LayerRoutingBody(BaseModel):
    """One token's routing in one MoE layer (the gRPC ``LayerRouting``)."""

    layer: int
    experts: list[int]
    weights: list[float]
    #: the group that served each expert ("" where none did)
    groups: list[str]


class TokenRoutingBody(BaseModel):
    """One generated token's routing (the gRPC ``TokenRouting``); ``index``: the token's in its choice."""

    token_id: int
    index: int
    layers: list[LayerRoutingBody]


class ChoiceRoutingTrace(BaseModel):
    """The routing of a choice's tokens (all of them in a whole response, the chunk's in a streamed one)."""

    index: int
    tokens: list[TokenRoutingBody]


class _RoutingTraceExtra(BaseModel):
    """A response whose ``routing_trace`` field (expertmesh's extra) is left out unless asked for: a request
    without a trace gets OpenAI's shape exactly."""

    @model_serializer(mode="wrap")
    def _without_an_unasked_trace(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if getattr(self, "routing_trace", None) is None:
            out.pop("routing_trace", None)
        return out


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions API's log-probabilities: one entry per token of the choice's text."""

    tokens: list[str]
    #: None for an echoed prompt's first token, which nothing predicts
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(_RoutingTraceExtra):
    """A whole completion, and also each chunk of a streamed one (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    routing_trace: list[ChoiceRoutingTrace] | None = None
    system_fingerprint: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(_RoutingTraceExtra):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    routing_trace: list[ChoiceRoutingTrace] | None = None
    system_fingerprint: None = None


class DeltaToolCall(ToolCall):
    """A tool call in a streamed chunk: ``index`` places it among the choice's calls."""

    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_RoutingTraceExtra):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    routing_trace: list[ChoiceRoutingTrace] | None = None
    system_fingerprint: None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "expertmesh"
    #: vLLM's extension: the longest prompt + completion the model takes, in tokens
    max_model_len: int | None = None


# -- the tokenizer routes (vLLM's /tokenize and /detokenize) --------------------------------------------------


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt: its token ids as /v1/completions would feed them."""

    model_config = ConfigDict(extra="ignore", strict=True)  # as vLLM: fields it does not know are ignored

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with messages: the chat template's token ids, as /v1/chat/completions would feed them."""

    model_config = ConfigDict(extra="ignore", strict=True)  # as vLLM: fields it does not know are ignored

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # as vLLM: fields it does not know are ignored

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
