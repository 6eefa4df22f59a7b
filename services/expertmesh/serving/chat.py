"""Chat messages to prompt token ids, with the checkpoint's own chat template.

The template is the model's contract for turning a conversation into tokens
(role markers, special tokens, where the assistant's turn begins). Guessing one
would feed the model text it was never trained on and answer with status OK,
so a checkpoint without ``tokenizer.chat_template`` refuses chat requests with
a 400 that says so and points at ``/v1/completions``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from expertmesh.serving.openai_errors import ApiError
from expertmesh.serving.openai_schema import ChatMessage


def chat_prompt_ids(
    tokenizer,
    messages: Sequence[ChatMessage],
    model: str,
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of ``messages`` rendered by the model's chat template, ending where the assistant's turn starts
    (``add_generation_prompt``; else after the last message). ``tools`` (OpenAI's tool objects) go to the
    template as transformers passes them (``tools=``): a template that knows tools writes them in its own
    format, one that does not ignores them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError.bad_request(
            f"the model {model} has no chat template (tokenizer.chat_template), so chat messages cannot be "
            "turned into its prompt format; send a plain prompt to /v1/completions instead",
            param="messages",
            code="chat_template_missing",
        )
    conversation = [_template_message(message) for message in messages]
    extra = {"tools": list(tools)} if tools else {}
    try:
        encoded = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True, **extra
        )
    except (
        TemplateError
    ) as err:  # templates refuse what they cannot render (e.g. a system message) with raise_exception
        raise ApiError.bad_request(
            f"the model's chat template refused these messages: {err}", param="messages"
        ) from None
    return list(encoded["input_ids"])


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: OpenAI sends a call's arguments as JSON text, templates (Hermes,
    Qwen, Llama 3) iterate them as a mapping, as vLLM hands them over."""
    turn = message.model_dump(exclude_none=True)
    for call in turn.get("tool_calls", ()):
        try:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            pass  # not JSON: the template gets the text as sent
    return turn
