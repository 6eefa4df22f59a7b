"""Tool calls: the grammar a forced call follows, and the calls read back from an answer's text. Pure.

- *named* (``tool_choice`` names a function): the answer is that function's arguments, a JSON object its
  ``parameters`` schema shapes; the call is that function with that text.
- *required*: the answer is a JSON array of ``{"name": ..., "parameters": {...}}`` (one item unless
  ``parallel_tool_calls``), each item one tool's name and arguments (vLLM's form, so the same
  checkpoints behave alike on both).
- *auto*: the model writes what it likes; calls are read back when the text is one, in the forms chat
  templates teach: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (Hermes, Qwen), or the
  whole text one such object or an array of them (Llama 3, Mistral after ``[TOOL_CALLS]``). Anything else is
  the answer's content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: any JSON object: the arguments of a function that declares no parameters schema
ANY_OBJECT: dict[str, Any] = {"type": "object"}

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"


@dataclass(frozen=True)
class Call:
    """One call: its id, the function's name, and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_schema(tools: Sequence[tuple[str, dict[str, Any] | None]], named: str | None, parallel: bool) -> dict:
    """(name, parameters schema) of each tool, the named function (None: any, as "required") -> the JSON
    schema of the answer."""
    params = {name: schema if schema else ANY_OBJECT for name, schema in tools}
    if named is not None:
        return params[named]
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
    }
    array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return array


def named_calls(text: str, name: str, new_id: Callable[[], str] = new_call_id) -> list[Call] | None:
    """The answer of a named tool choice -> its one call (None: the text is not a whole JSON value, e.g. cut
    short by max_tokens)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return None
    return [Call(new_id(), name, text.strip())]


def required_calls(text: str, new_id: Callable[[], str] = new_call_id) -> list[Call] | None:
    """The answer of tool_choice "required" (a JSON array of name and parameters) -> its calls."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [_call(item, new_id) for item in items]
    return None if None in calls else calls


def auto_calls(
    text: str, tool_names: Sequence[str], new_id: Callable[[], str] = new_call_id
) -> tuple[str, list[Call]] | None:
    """An answer under tool_choice "auto" -> (the content beside the calls, the calls), or None when it
    calls nothing (every call must name one of ``tool_names``)."""
    known = set(tool_names)
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = [_call(_loads(block), new_id, known) for block in tagged]
        if None in calls:
            return None
        return _TAGGED.sub("", text).strip(), calls
    body = text.strip()
    if body.startswith(_MISTRAL):
        body = body[len(_MISTRAL) :].strip()
    value = _loads(body)
    items = value if isinstance(value, list) and value else [value]
    calls = [_call(item, new_id, known) for item in items]
    return None if None in calls else ("", calls)


def may_be_a_call(text: str) -> bool:
    """Whether a streamed answer's text so far could still turn out to be tool calls (it is held back, not
    streamed as content, until it is known)."""
    head = text.lstrip()
    return any(head.startswith(start) or start.startswith(head) for start in ("<tool_call>", _MISTRAL, "{", "["))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(item: Any, new_id: Callable[[], str], known: set[str] | None = None) -> Call | None:
    """``{"name": ..., "arguments" or "parameters": {...}}`` -> a Call (None: not one)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    if known is not None and item["name"] not in known:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some templates teach the arguments as JSON text already
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return Call(new_id(), item["name"], json.dumps(args, ensure_ascii=False))
