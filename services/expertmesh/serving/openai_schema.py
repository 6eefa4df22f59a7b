"""The OpenAI wire shapes of the HTTP API (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models`` and the error body), as pydantic models.

Requests follow OpenAI's rules: unknown fields are ignored (clients and SDKs
send extras freely), types are strict (``"0.5"`` is not a temperature), and
``null`` means "the default". Fields OpenAI defines that this server cannot
honour (``best_of``, ``suffix``, the deprecated ``functions``) are refused with an
error naming the field rather than dropped: a caller who asks for something must
not silently get something else. ``response_format`` (JSON, or JSON that
validates against a schema) and ``tools`` with ``tool_choice`` are honoured
through a grammar mask on each choice's tokens (``serving.grammar``,
``serving.tool_calls``); ``n`` choices share their prompt's prefill. ``logit_bias`` and the frequency and
presence penalties are OpenAI's; ``top_k``, ``ignore_eos`` (generate past the
end-of-sequence token, for benchmarks), ``repetition_penalty``, ``min_tokens``
and ``stop_token_ids`` are extensions, as in vLLM (``sampling`` says what each
does to the logits); ``routing_policy``, ``domain`` and ``routing_trace`` are
expertmesh's (the last adds a ``routing_trace`` field to the response, only then).

Shapes are left as OpenAI has them, with ``null`` where a field does not apply
(``logprobs`` unless asked for, ``system_fingerprint``): SDKs parse them with their own models. Log-probabilities
are the model's (the log-softmax of its logits, before any control or temperature), as vLLM reports them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from expertmesh.serving.grammar import GrammarError, GrammarSpec
from expertmesh.serving.sampling import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from expertmesh.serving.text_stream import stop_problems
from expertmesh.serving.tool_calls import call_schema

#: validation context key: the server's cap on tokens generated per request
MAX_TOKENS_CAP = "max_tokens_cap"

#: why a generation ended, in OpenAI's words (end-of-sequence and stop strings are both "stop"; an answer
#: that is tool calls is "tool_calls")
FinishReason = Literal["stop", "length", "tool_calls"]

#: tools one request may offer (OpenAI's limit)
MAX_TOOLS = 128


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
    k_max: int | None = Field(None, ge=0, le=2**32 - 1)
    noise_scale: float | None = None
    sticky_strength: float | None = None
    sticky_decay: float | None = None
    queue_slo_ms: float | None = None
    force: bool = False


def _policy_object(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class ConsistencyGuardBody(BaseModel):
    """expertmesh's extra ``consistency_guard`` body field as an object (a plain string names the scorer; ""
    turns the server's default off); checked by the router, as on gRPC."""

    model_config = ConfigDict(extra="forbid", strict=True)

    scorer: str = Field(max_length=32)
    threshold: float | None = None
    max_regenerations: int | None = Field(None, ge=0, le=2**32 - 1)  # the gRPC field is a uint32
    recompute: str | None = Field(None, max_length=16)


def _guard_object(value: Any) -> Any:
    return {"scorer": value} if isinstance(value, str) else value


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must validate against. The mask holds every
    answer to it, ``strict`` or not (as vLLM does)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON that validates against a schema."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _with_its_type(cls, value: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        if value is not None and info.data.get("type") != "json_schema":
            raise PydanticCustomError("invalid_value", "json_schema goes with type 'json_schema'")
        return value

    def spec(self) -> GrammarSpec | None:
        """The grammar this format asks for (None: free text)."""
        if self.type == "json_object":
            return GrammarSpec.json_object()
        if self.type == "json_schema":
            if self.json_schema is None:
                raise GrammarError("response_format.json_schema", "type 'json_schema' needs a json_schema object")
            return GrammarSpec.json_schema(self.json_schema.schema_)
        return None


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
    #: choices to generate for the prompt, each with its own sampler (seed + i when seeded)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    response_format: ResponseFormat | None = None
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
    #: expertmesh extra: the consistency guard of a non-exact request (see the gRPC GenerateRequest)
    consistency_guard: Annotated[ConsistencyGuardBody, BeforeValidator(_guard_object)] | None = None
    #: expertmesh extra: each new token's routing in the response (``routing_trace`` beside ``usage``; the
    #: header ``X-Expertmesh-Routing-Trace: 1`` asks the same); bounded as on the gRPC API
    routing_trace: bool | None = None
    #: vLLM's extra: shares prefix-cached KV blocks only with requests of the same salt (bounded by the builder)
    cache_salt: str | None = None
    #: OpenAI's end-user id: a canary's key when the x-expertmesh-canary-key header is absent (``serving.canary``)
    user: str | None = None

    _check_stop = field_validator("stop")(_stop_limits)
    _check_cap = field_validator("max_tokens")(_within_cap)

    @field_validator("temperature")
    @classmethod
    def _usable_temperature(cls, temperature: float | None) -> float | None:
        problems = [] if temperature is None else SamplingParams(temperature=temperature).problems()
        if problems:
            raise PydanticCustomError("invalid_value", problems[0])
        return temperature

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
    def field_names(self) -> dict[str, str]:
        """This body's names of the fields the request builder names otherwise (``RequestSpec.names``)."""
        return {"prompt": self.PROMPT_FIELD, "max_new_tokens": "max_tokens", "logprobs": "logprobs"}

    @property
    def choices(self) -> int:
        return self.n or 1

    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar the answer must follow (None: free text); GrammarError names a field it cannot take."""
        return self.response_format.spec() if self.response_format is not None else None

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


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(max_length=64)
    #: the call's arguments as JSON text (OpenAI's shape: a string, not an object)
    arguments: str


class ToolCall(BaseModel):
    """A call the assistant made: in an answer's ``message.tool_calls``, and in an earlier assistant turn."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # Validated in this order: each field's check reads the ones before it.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    #: an assistant turn's tool calls, and a tool turn's answer to which call
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256, validate_default=True)
    name: str | None = None
    #: may be null (or absent) only in an assistant turn that made tool calls
    content: Annotated[str, BeforeValidator(_text_content)] | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, calls: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if calls and info.data.get("role") != "assistant":
            raise PydanticCustomError("invalid_value", "tool_calls belong to a message of role 'assistant'")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answers(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if value is not None and role != "tool":
            raise PydanticCustomError("invalid_value", "tool_call_id belongs to a message of role 'tool'")
        if value is None and role == "tool":
            raise PydanticCustomError("missing", "a message of role 'tool' needs the tool_call_id it answers")
        return value

    @field_validator("content")
    @classmethod
    def _content_unless_calls(cls, content: str | None, info: ValidationInfo) -> str | None:
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError(
                "missing", "content is required (only an assistant turn with tool_calls may omit it)"
            )
        return content


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: FunctionName
    description: str | None = None
    #: a JSON schema of the arguments (absent: any JSON object)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(max_length=64)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function the answer must call."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    PROMPT_FIELD = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    #: "none", "auto" (the default with tools: the model decides), "required" (at least one call) or a named function
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: whether "required" may make several calls (OpenAI's default: true)
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

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

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, functions: list[Any] | None) -> list[Any] | None:
        if functions:
            raise _unsupported("functions (deprecated by OpenAI: send tools)")
        return functions

    @field_validator("tool_choice")
    @classmethod
    def _a_known_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if choice not in (None, "none") and not tools:
            raise PydanticCustomError("invalid_value", "tool_choice needs tools to choose from")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise PydanticCustomError(
                "invalid_value", "names {name!r}, which is not one of the tools", {"name": choice.function.name}
            )
        return choice

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How the answer may call tools: not at all, as the model decides, at least once, or the one named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def grammar_spec(self) -> GrammarSpec | None:
        """A required or named tool call is JSON the tools' schemas shape (``tool_calls.call_schema``); else
        the response format's."""
        mode = self.tool_mode
        if mode in ("required", "named"):
            if self.response_format is not None and self.response_format.type != "text":
                raise GrammarError("response_format", f"does not combine with tool_choice {mode!r}: choose one")
            name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            schema = call_schema(
                [(t.function.name, t.function.parameters) for t in self.tools or ()],
                name,
                self.parallel_tool_calls is not False,
            )
            return GrammarSpec.json_schema(schema, "tools")
        return super().grammar_spec()

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` is OpenAI's newer name of ``max_tokens``; it wins when both are set."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def field_names(self) -> dict[str, str]:
        newer = self.max_completion_tokens is not None
        return {
            **super().field_names,
            "max_new_tokens": "max_completion_tokens" if newer else "max_tokens",
            "logprobs": "top_logprobs",
        }
