"""OpenAI requests into the fleet's own, and the fleet's results and stream events back (pure: no I/O).

Requests
    ``max_tokens`` (chat: ``max_completion_tokens`` first) → ``max_new_tokens``. A field the caller
    leaves unset takes the model's ``generation_config.json`` default (as every face does), else
    OpenAI's: ``max_tokens`` 16 on ``/v1/completions``, the model's ``limits.max_new_tokens`` on chat
    (a default is cut to what fits beside the prompt), temperature 1.
    ``temperature`` (0 = greedy), ``top_p`` (0 = greedy, as OpenAI allows), ``seed`` (default 0: the fleet's
    sampling is always seeded, so equal requests give equal tokens), ``stop`` (a string or a list)
    map one to one, as do the fleet extensions ``top_k``, ``repetition_penalty``, ``ignore_eos``,
    ``stop_token_ids``. Refused with a 400 naming the field: ``n``/``best_of`` other than 1,
    non-zero ``frequency_penalty``/``presence_penalty`` (the fleet has ``repetition_penalty``
    instead), ``logit_bias``, ``logprobs``/``top_logprobs``, ``echo``, ``suffix``, ``tools``,
    ``tool_choice`` other than "none", ``response_format`` other than text, embedding ``dimensions``,
    chat's ``store`` true, ``modalities`` other than text, ``reasoning_effort``, ``verbosity``,
    ``prediction``, ``audio``, ``web_search_options``, ``functions``, ``function_call`` other than "none",
    a message's ``tool_calls``/``function_call``/``audio``/``refusal`` unless null (the SDKs send them
    null when a returned message is sent back); each refusal says why
    (:data:`gateway.openai_refusals._WHY_REFUSED`).

Results
    ``finish_reason``: the fleet's ``stop`` → "stop", ``length`` → "length", ``deadline`` →
    "length" (a time budget ran out), ``cancelled`` → "stop" (only another caller's cancel shows
    here; the native ``GET /v1/requests/{id}`` keeps the exact reason). ``usage`` is the worker's.

Where each part lives (this module re-exports them all)
    :mod:`gateway.openai_refusals` the refused fields; :mod:`gateway.openai_params` the sampling fields
    and error field names; :mod:`gateway.openai_prompts` prompts, messages and inputs;
    :mod:`gateway.openai_results` results, stream chunks and finish reasons.
"""

from __future__ import annotations

from gateway.openai_params import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    Face,
    generation_fallbacks,
    generation_params,
    max_tokens_field,
    rename_field,
    wrong_kind,
)
from gateway.openai_prompts import (
    Prompt,
    chat_messages,
    completion_prompt,
    embedding_inputs,
    input_field,
    prompt_field,
)
from gateway.openai_refusals import check_supported
from gateway.openai_results import (
    ChunkWriter,
    chat_response,
    completion_response,
    embedding_list,
    finish_reason,
    stream_error,
)

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "DEFAULT_TEMPERATURE",
    "ChunkWriter",
    "Face",
    "Prompt",
    "chat_messages",
    "chat_response",
    "check_supported",
    "completion_prompt",
    "completion_response",
    "embedding_inputs",
    "embedding_list",
    "finish_reason",
    "generation_fallbacks",
    "generation_params",
    "input_field",
    "max_tokens_field",
    "prompt_field",
    "rename_field",
    "stream_error",
    "wrong_kind",
]
