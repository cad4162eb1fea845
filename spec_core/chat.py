"""Prompts to token ids, and token ids to text: the one place every entry point encodes and decodes.

- A plain prompt is encoded as ``tokenizer(prompt)`` encodes it, with whatever special tokens the tokenizer
  itself adds (SmolLM2 adds none).
- Messages (an OpenAI-style list of ``{"role", "content"}``) go through the tokenizer's chat template with
  ``add_generation_prompt=True``.
- Returned text leaves out special tokens (``<|im_end|>`` and the like); token ids keep them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages: object, where: str = "messages") -> list[dict[str, str]]:
    """A validated copy of ``messages`` (``ValueError`` naming what is wrong)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"{where}[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def read_messages_file(path: str | Path) -> list[dict[str, str]]:
    """An OpenAI-style message list from a JSON file: a list, or an object with a ``messages`` list."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"messages file not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    return check_messages(data, where=str(p))


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt)["input_ids"])


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's ids for ``messages`` with the assistant turn opened (``ValueError`` without one)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    out = tokenizer.apply_chat_template(check_messages(messages), add_generation_prompt=True, tokenize=True,
                                        return_dict=True)
    return list(out["input_ids"])


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A prompt given as messages (rendered by the chat template), next to plain text and token ids."""

    messages: tuple[tuple[str, str], ...]

    @staticmethod
    def of(messages: object, where: str = "messages") -> ChatPrompt:
        return ChatPrompt(tuple((m["role"], m["content"]) for m in check_messages(messages, where)))

    def as_list(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


#: What a request may carry: text, token ids, or messages.
Prompt = str | list[int] | ChatPrompt


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids for any :data:`Prompt` (ids are passed through unchanged)."""
    if isinstance(prompt, ChatPrompt):
        return encode_messages(tokenizer, prompt.as_list())
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt)
    return list(prompt)


def decode(tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` without special tokens."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
