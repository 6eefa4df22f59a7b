"""The chat template of the embedded and tiny models: ChatML, with a system turn and tool turns.

ChatML (``<|im_start|>role\\n...<|im_end|>\\n``) is what Qwen, Hermes and many fine-tunes use, so a client that
chats with the embedded model sees the prompt shape it would see on a real checkpoint. Tools follow the
Hermes/Qwen convention the serving side reads back (``serving.tool_calls``): the offered functions as JSON
lines inside ``<tools>`` in the system turn (with a terse instruction: the embedded model's context is 512 byte
tokens), an assistant's calls as ``<tool_call>{"name", "arguments"}</tool_call>`` blocks, a tool's answer as a
``<tool_response>`` in a user turn. OpenAI's ``developer`` role is a
system turn. With ``add_generation_prompt`` the rendering ends where the assistant's turn begins.

The tiny models have random weights: the template gives them a real prompt format, not sensible answers.
"""

from __future__ import annotations

__all__ = ["CHATML"]

CHATML = (
    "{%- set system = messages[0].content if messages and messages[0].role in ('system', 'developer') else none %}"
    "{%- if system is not none or tools %}"
    "<|im_start|>system\n"
    "{% if system is not none %}{{ system }}{% else %}You are a helpful assistant.{% endif %}"
    "{% if tools %}{{ '\\n' }}\n# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ (tool.function if tool.function is defined else tool) | tojson }}"
    "{% endfor %}{{ '\\n' }}"
    '</tools>\nTo call one, answer <tool_call>{"name": <name>, "arguments": <object>}'
    "</tool_call>.{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and system is not none %}"
    "{% elif message.role in ('system', 'developer') %}"
    "<|im_start|>system\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}"
    "<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}\n'
    "</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
