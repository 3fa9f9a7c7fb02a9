"""One OpenAI generation built as a fleet request (blocking: run in a worker thread): the chat
template's rendering of a conversation as token ids, the prompt tokenized, the sampling fields mapped
(:mod:`gateway.openai_mapping`) and validated, each refusal naming the caller's field.

Shared by ``/v1/completions``, ``/v1/chat/completions`` (:mod:`gateway.openai_routes`) and
``/v1/responses`` (:mod:`gateway.responses_routes`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from gateway.chat import ChatTemplate, load_chat, render_chat
from gateway.deps import Gateway
from gateway.openai_mapping import (
    Prompt,
    chat_messages,
    generation_fallbacks,
    generation_params,
    max_tokens_field,
    rename_field,
    wrong_kind,
)
from gateway.openai_schema import ChatBody, CompletionBody
from protocol.errors import InvalidRequest
from protocol.messages import InferenceRequest, OutputSpec
from protocol.validation import resolve_output

__all__ = ["build_generation", "chat_prompt"]


@lru_cache(maxsize=64)
def _chat_template(path: Path) -> ChatTemplate | None:
    """Read once per model file and process: a template added later needs a gateway restart. None when
    the model's folder has none (or is not on this machine)."""
    return load_chat(path)


def build_generation(gw: Gateway, body: CompletionBody | ChatBody, prompt: Prompt, field: str) -> InferenceRequest:
    """Tokenize, map the sampling fields and validate one generation (runs in a worker thread).

    Fields the body leaves unset are resolved by :meth:`FleetClient.build_request` (the model's
    ``generation_config.json``, else OpenAI's defaults), as on every face.

    Raises:
        InvalidRequest: naming the OpenAI field (``prompt``/``messages``, ``max_tokens``, …).
    """
    names = {"input_ids": field, "text": field, "max_new_tokens": max_tokens_field(body)}
    try:
        key = gw.settings.model_key(body.model)
        _refuse_unfit(gw, key, body.model)
        ids, text = prompt
        ids = ids if ids is not None else gw.fleet.tokenize(key, text or "")
        fallbacks = generation_fallbacks(
            "completion" if isinstance(body, CompletionBody) else "chat", gw.settings.models[key].limits.max_new_tokens
        )
        return gw.fleet.build_request(
            key, ids, kind="generate", generation=generation_params(body), generation_fallbacks=fallbacks
        )
    except InvalidRequest as exc:
        refused = wrong_kind(exc, body.model, "generate text", "an encoder model answers POST /v1/embeddings")
        raise rename_field(refused, names, prefix="output.generation.") from exc


def _refuse_unfit(gw: Gateway, key: str, model: str) -> None:
    """OpenAI's generating routes answer in generated text: refuse a model that does not generate (an
    encoder) or has no tokenizer (it could only answer ``""``), before anything else is looked at (a chat
    template, the prompt), so the refusal names the model rather than what it lacks for a generation.

    Raises:
        InvalidRequest: (field ``model``) the model's card says another kind than ``causal_lm``, or
            tokenizer ``none``.
    """
    card = gw.fleet.model_card(key)
    if card is None:  # not known here: build_request finds the kind out (the worker's card in Redis)
        return
    if card.kind != "causal_lm":  # resolve_output words the refusal, as build_request's would be
        try:
            resolve_output(OutputSpec(kind="generate"), model_kind=card.kind, limits=gw.settings.models[key].limits)
        except InvalidRequest as exc:
            raise wrong_kind(exc, model, "generate text", "an encoder model answers POST /v1/embeddings") from exc
    if card.tokenizer == "none":
        raise InvalidRequest(
            f"model {model!r} has no tokenizer (its card says tokenizer 'none'), so it cannot answer in text: "
            "POST /v1/requests with output.kind 'generate' returns the generated token ids",
            "model",
            "a model with a tokenizer",
        )


def chat_prompt(gw: Gateway, body: ChatBody) -> Prompt:
    """The conversation rendered by the model's chat template, as token ids.

    Raises:
        InvalidRequest: a model that cannot generate text (field ``model``: :func:`_refuse_unfit`); no
            template, the template refuses the messages, or no tokenizer (field ``messages``).
    """
    key = gw.settings.model_key(body.model)
    _refuse_unfit(gw, key, body.model)
    template = _chat_template(gw.settings.models[key].path)
    if template is None:
        raise InvalidRequest(
            f"model {body.model!r} has no chat template (chat_template in tokenizer_config.json or "
            "chat_template.jinja next to its file): use /v1/completions with a prompt",
            "messages",
        )
    text = render_chat(template, chat_messages(body))
    try:
        # the template wrote the special tokens it wants (``{{ bos_token }}``): the tokenizer must not
        # add its own (a second BOS), as transformers' apply_chat_template does not
        return gw.fleet.tokenize(key, text, add_special_tokens=False), None
    except InvalidRequest as exc:
        raise rename_field(exc, {"text": "messages"}) from exc
