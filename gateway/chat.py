"""Chat prompts: a model's chat template rendered with Jinja2, as transformers renders it.

The template comes from :func:`protocol.generation_config.load_chat_template` (``chat_template.jinja``
or ``tokenizer_config.json`` in the model file's folder); ``bos_token``/``eos_token`` strings from
``tokenizer_config.json`` (``""`` when absent). It is rendered in a sandbox with ``messages``,
``add_generation_prompt=True`` and those two strings, with ``trim_blocks``/``lstrip_blocks``.
Messages reach the template as ``{"role", "content"}`` with content a plain string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from protocol.errors import InvalidRequest
from protocol.generation_config import load_chat_template

__all__ = ["ChatTemplate", "load_chat", "render_chat"]

TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template and the special-token strings templates may use."""

    source: str
    bos_token: str = ""
    eos_token: str = ""


def _special_tokens(folder: Path) -> tuple[str, str]:
    """``bos_token``, ``eos_token`` of ``tokenizer_config.json`` (a string or ``{"content": ...}``), else ``""``."""
    try:
        doc = json.loads((folder / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "", ""

    def text(value: Any) -> str:
        value = value.get("content", "") if isinstance(value, dict) else value
        return value if isinstance(value, str) else ""

    return (text(doc.get("bos_token")), text(doc.get("eos_token"))) if isinstance(doc, dict) else ("", "")


def load_chat(model_path: Path) -> ChatTemplate | None:
    """The chat template of the model file ``model_path``; None when its folder has none.

    Raises:
        ModelLoadError: a template file that cannot be read (see ``load_chat_template``).
    """
    source = load_chat_template(model_path)
    if source is None or not source.strip():
        return None
    return ChatTemplate(source, *_special_tokens(Path(model_path).parent))


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=32)
def _compiled(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def render_chat(template: ChatTemplate, messages: list[dict[str, Any]]) -> str:
    """The prompt text of ``messages`` (each ``{"role", "content"}``, content a string).

    Raises:
        InvalidRequest: the template refuses the conversation (``raise_exception``) or fails to render;
            field ``messages``.
    """
    try:
        return _compiled(template.source).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=template.bos_token,
            eos_token=template.eos_token,
        )
    except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:  # a template's own errors
        raise InvalidRequest(f"the model's chat template cannot render these messages: {exc}", "messages") from exc
