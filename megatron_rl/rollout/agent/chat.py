"""Token ids of a session's pieces, from the tokenizer's own chat template (token in, token out).

The trainer trains on the ids the engine generated and the ids of the observations appended
after them -- never on a re-tokenised transcript. ``ChatFormat`` makes those observation ids:

* ``prompt_ids(messages)``: the first prompt, rendered with the tools' schemas
  (``apply_chat_template(..., tools=..., add_generation_prompt=True)``), then encoded.
* ``observation_ids(tool_messages)``: what the template puts after a model turn that ended with
  its end-of-turn token (eos) and called tools: the template's tail after the eos (ChatML: a
  newline), then the tool messages and the next assistant header. Rendered, as verl's
  continuous-token builder does, as the difference of two renderings after a stand-in
  conversation (a user message and an assistant message calling the tools), so it does not
  depend on how the template re-renders the session's own history.
* ``transcript_ids(messages)``: the re-tokenised transcript, only for the sanity check
  (``multi_turn.tokenization_sanity_check_mode``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["ChatFormat", "TOOL_CHATML_TEMPLATE"]

TOOL_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{{- '\\n- ' + tool.function.name + ': ' + tool.function.description }}{%- endfor %}"
    '{{- \'\\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)"
    " + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with Qwen's tool conventions, compact enough for a tiny model's context: a system block
listing the tools (name: description) when there are any, assistant ``tool_calls`` rendered as
``<tool_call>\\n{json}\\n</tool_call>`` blocks, consecutive tool messages grouped into one user
turn of ``<tool_response>`` blocks. The toy agentic task's tokenizer carries it."""


class ChatFormat:
    """Renders and encodes chat messages with ``tokenizer`` (see the module docstring).

    Args:
        tokenizer: an HF tokenizer with a chat template (or ``chat_template``).
        tools: OpenAI tool schemas the template lists (None: no tools).
        chat_template: a Jinja template replacing the tokenizer's (``model.custom_chat_template``).
    """

    def __init__(self, tokenizer: Any, tools: Optional[Sequence[dict]] = None, chat_template: Optional[str] = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.chat_template = chat_template
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "agent sessions need a chat template: the tokenizer has none and "
                "actor_rollout_ref.model.custom_chat_template is not set"
            )
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError("agent sessions need the tokenizer's eos token (it ends every model turn)")

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool) -> str:
        """The template's text for ``messages``."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The first prompt: ``messages`` and an open assistant turn."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation_ids(self, tool_messages: Sequence[dict]) -> list[int]:
        """The ids appended after a model turn that ended with eos and called tools (module docstring)."""
        stand_in = [
            {"role": "user", "content": "?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": m.get("name") or "tool", "arguments": {}}}
                    for m in tool_messages
                ],
            },
        ]
        prefix = self.encode(self.render(stand_in, add_generation_prompt=False))
        full = self.encode(self.render([*stand_in, *tool_messages], add_generation_prompt=True))
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "the chat template does not render tool messages by appending to the conversation "
                "(the rendering of the earlier messages changed); agent sessions need an append-only "
                "template"
            )
        tail = prefix[len(prefix) - prefix[::-1].index(self.eos_token_id) :] if self.eos_token_id in prefix else []
        return tail + full[len(prefix) :]

    def transcript_ids(self, messages: Sequence[dict]) -> list[int]:
        """The re-tokenised transcript (sanity check only)."""
        return self.encode(self.render(messages, add_generation_prompt=False))
