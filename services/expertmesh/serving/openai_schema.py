"""The OpenAI wire shapes of the HTTP API (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models`` and the error body), as pydantic models.

Requests follow OpenAI's rules: unknown fields are ignored (clients and SDKs
send extras freely), types are strict (``"0.5"`` is not a temperature), and
``null`` means "the default". Fields OpenAI defines that this server cannot
honour (``n`` > 1, ``best_of``, ``suffix``, tools, JSON
modes) are refused with an error naming the field rather than dropped: a caller
who asks for five samples must not get one. ``logit_bias`` and the frequency and
presence penalties are OpenAI's; ``top_k``, ``ignore_eos`` (generate past the
end-of-sequence token, for benchmarks), ``repetition_penalty``, ``min_tokens``
and ``stop_token_ids`` are extensions, as in vLLM (``sampling`` says what each
does to the logits).

Shapes are left as OpenAI has them, with ``null`` where a field does not apply
(``logprobs`` unless asked for, ``system_fingerprint``): SDKs parse them with their own models. Log-probabilities
are the model's (the log-softmax of its logits, before any control or temperature), as vLLM reports them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from expertmesh.serving.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from expertmesh.serving.text_stream import stop_problems

#: validation context key: the server's cap on tokens generated per request
MAX_TOKENS_CAP = "max_tokens_cap"

#: why a generation ended, in OpenAI's words (end-of-sequence and stop strings are both "stop")
FinishReason = Literal["stop", "length"]


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", "{what} is not supported by this server", {"what": what})


def _as_stop_list(value: Any) -> Any:
    """OpenAI's ``stop`` is a string, a list of strings, or null."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


def _stop_limits(stop: list[str]) -> list[str]:
    problems = stop_problems(stop)
    if problems:
        raise PydanticCustomError("invalid_value", "; ".join(problems))
    return stop


Stop = Annotated[list[str], BeforeValidator(_as_stop_list)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    #: one more chunk before ``[DONE]``, with no choices and the request's token usage
    include_usage: bool | None = None


def _within_cap(value: int | None, info: ValidationInfo) -> int | None:
    cap = (info.context or {}).get(MAX_TOKENS_CAP)
    if value is not None and cap is not None and value > cap:
        raise PydanticCustomError(
            "invalid_value", "{value} is above this server's cap of {cap}", {"value": value, "cap": cap}
        )
    return value


class RoutingPolicyBody(BaseModel):
    """expertmesh's extra ``routing_policy`` body field as an object (a plain string names the policy);
    names and ranges as ListModels reports them, checked by the router."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = ""
    alpha: float | None = None
    top_n: int | None = Field(None, ge=0, le=2**32 - 1)  # the gRPC field is a uint32
    delta: float | None = None
    weight_boost: float | None = None
    threshold: float | None = None
    k_start: int | None = Field(None, ge=0, le=2**32 - 1)
    decay: float | None = None
    k_min: int | None = Field(None, ge=0, le=2**32 - 1)
    tau: float | None = None
    capacity_factor: float | None = None
    force: bool = False


def _policy_object(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class GenerationFields(BaseModel):
    """What completions and chat completions share; ``None`` takes the server's default.
    Validate with ``context={MAX_TOKENS_CAP: n}`` to hold ``max_tokens`` to the server's cap."""

    model_config = ConfigDict(extra="ignore", strict=True)
    #: the field that holds the prompt, named in errors about it
    PROMPT_FIELD: ClassVar[str]

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Stop = []
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    #: token id (a decimal string, as OpenAI's JSON has it) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    #: vLLM's extras: the repetition penalty (> 0, 1 is none), new tokens before EOS may end the
    #: completion, and token ids that end it as EOS does
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    #: expertmesh extras: the request's routing policy and its query domain (see the gRPC GenerateRequest)
    #: a plain string names the policy (``{"name": ...}``), so errors name the object's fields
    routing_policy: Annotated[RoutingPolicyBody, BeforeValidator(_policy_object)] | None = None
    domain: str | None = None

    _check_stop = field_validator("stop")(_stop_limits)
    _check_cap = field_validator("max_tokens")(_within_cap)

    @field_validator("temperature")
    @classmethod
    def _usable_temperature(cls, temperature: float | None) -> float | None:
        problems = [] if temperature is None else SamplingParams(temperature=temperature).problems()
        if problems:
            raise PydanticCustomError("invalid_value", problems[0])
        return temperature

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise _unsupported(f"n={n} (one choice per request)")
        return n

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if not bias:
            return bias
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise PydanticCustomError(
                "invalid_value", "at most {n} token ids, got {got}", {"n": MAX_LOGIT_BIAS_TOKENS, "got": len(bias)}
            )
        for token, value in bias.items():
            if not (token.isascii() and token.isdigit()) or len(token) > 10:
                raise PydanticCustomError(
                    "invalid_value", "keys must be token ids (decimal integers), got {token!r}", {"token": token[:32]}
                )
            if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise PydanticCustomError(
                    "invalid_value",
                    "values must be in [-100, 100], got {value} for token {token}",
                    {"value": value, "token": token},
                )
        return bias

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and any(i < 0 for i in ids):
            raise PydanticCustomError("invalid_value", "token ids must be integers >= 0")
        return ids

    @property
    def token_biases(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(token), value) for token, value in (self.logit_bias or {}).items()))

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        """Most likely tokens to report beside each new token's log-probability (None: no log-probabilities)."""
        return None

    @property
    def echoes(self) -> bool:
        """Whether the answer starts with the prompt (the legacy completions' ``echo``)."""
        return False

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _one_prompt(value: Any) -> Any:
    """A prompt is a string or a list of token ids; a list holding one of those is that prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, list) and any(isinstance(v, (str, list)) for v in value):
        raise PydanticCustomError("unsupported_value", "one prompt per request: send a string or one list of token ids")
    if isinstance(value, str):
        return {"text": value}
    if isinstance(value, list):
        if not all(type(v) is int and v >= 0 for v in value):
            raise PydanticCustomError("invalid_value", "token ids must be integers >= 0")
        return {"token_ids": value}
    raise PydanticCustomError("invalid_type", "the prompt must be a string or a list of token ids")


class Prompt(BaseModel):
    """Exactly one of ``text`` and ``token_ids``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = None
    token_ids: list[int] | None = None


class CompletionRequest(GenerationFields):
    PROMPT_FIELD = "prompt"

    prompt: Annotated[Prompt, BeforeValidator(_one_prompt)]
    best_of: int | None = None
    echo: bool | None = None
    #: each new token's log-probability and this many most likely tokens' (OpenAI's legacy API allows 5)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def echoes(self) -> bool:
        return bool(self.echo)

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise _unsupported(f"best_of={best_of}")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise _unsupported("suffix")
        return suffix


def _text_content(value: Any) -> Any:
    """A message's content: a string, or a list of text parts (joined); other parts are refused."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise PydanticCustomError(
                "unsupported_value", "only text content parts are supported, got {kind}", {"kind": kind}
            )
        texts.append(part["text"])
    return "".join(texts)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # Tool and function messages would need tool calling, which this server does not do.
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_text_content)]
    name: str | None = None


class ChatCompletionRequest(GenerationFields):
    PROMPT_FIELD = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    _check_completion_cap = field_validator("max_completion_tokens")(_within_cap)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs set to true")
        return top

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, tools: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if tools:
            raise _unsupported(f"{info.field_name} (tool calling)")
        return tools

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        if fmt is not None and fmt.get("type") != "text":
            raise _unsupported(f"response_format {fmt.get('type')!r} (only 'text')")
        return fmt

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` is OpenAI's newer name of ``max_tokens``; it wins when both are set."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ----------------------------------------------------------------------------


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


class Completion(BaseModel):
    """A whole completion, and also each chunk of a streamed one (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
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
