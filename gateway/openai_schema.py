"""Bodies of the OpenAI-compatible routes, as OpenAI names them, and the responses they get.

Requests are parsed leniently enough for the official SDKs (every field they send is declared) and
strictly otherwise: an unknown field is a 400 naming it, and a field the fleet cannot honour
(``n`` > 1, penalties, tools, logprobs, …) is refused by :mod:`gateway.openai_mapping` with a 400
naming it too. Fleet extensions ride in the same body (``extra_body`` in the SDKs): ``top_k``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``. Every string, inside ``Any`` fields too, must
encode as UTF-8 (:mod:`protocol.utf8`): a lone surrogate is a 400 naming where it is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, StringConstraints

from protocol.messages import RequestFloat
from protocol.utf8 import UTF8_STRINGS, Utf8Json, Utf8Str

__all__ = [
    "METADATA_KEY_CHARS",
    "METADATA_PAIRS",
    "METADATA_VALUE_CHARS",
    "USER_CHARS",
    "ChatBody",
    "ChatChoice",
    "ChatCompletion",
    "ChatMessage",
    "CompletionBody",
    "CompletionChoice",
    "CompletionResponse",
    "ContentPart",
    "EmbeddingBody",
    "EmbeddingData",
    "EmbeddingList",
    "EmbeddingUsage",
    "EndUser",
    "Metadata",
    "ModelObject",
    "ModelObjectList",
    "StreamOptions",
]

METADATA_PAIRS = 16
"""Most key-value pairs of a ``metadata`` object (OpenAI's bound, on chat completions and responses alike)."""
METADATA_KEY_CHARS = 64
"""Longest ``metadata`` key (characters; OpenAI's bound)."""
METADATA_VALUE_CHARS = 512
"""Longest ``metadata`` value (characters; OpenAI's bound)."""
USER_CHARS = 256
"""Longest ``user`` (characters). OpenAI documents none for ``user`` and 64 for its successor
``safety_identifier``; 256 passes an e-mail address or a hash as an end-user ID, and a stored response (which
keeps ``user`` for ``api.responses_ttl_s``) stays small."""

_UTF8_CHECK: Any = get_args(Utf8Str)[-1]
""":data:`protocol.utf8.Utf8Str`'s check, put after a length bound so that the bound is str's own ("String
should have at most 64 characters"): a bound put after the check (``Annotated[Utf8Str, Field(max_length=...)]``
inside a dict) is judged as a generic length ("Value should have at most 64 items")."""
MetadataKey = Annotated[StrictStr, StringConstraints(max_length=METADATA_KEY_CHARS), _UTF8_CHECK]
MetadataValue = Annotated[StrictStr, StringConstraints(max_length=METADATA_VALUE_CHARS), _UTF8_CHECK]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=METADATA_PAIRS)]
"""OpenAI's ``metadata``: at most :data:`METADATA_PAIRS` pairs of UTF-8 strings, keys of at most
:data:`METADATA_KEY_CHARS` characters, values of at most :data:`METADATA_VALUE_CHARS`; more is a 400 naming the
field (``metadata``, or ``metadata.<key>`` for a value) and the limit."""
EndUser = Annotated[StrictStr, StringConstraints(max_length=USER_CHARS), _UTF8_CHECK]
"""OpenAI's ``user`` (an end-user ID; the fleet's sticky key of a canary split): a UTF-8 string of at most
:data:`USER_CHARS` characters."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    """``include_usage``: one more chunk before ``[DONE]``, with ``usage`` and no choices.
    ``continuous_usage_stats`` (vLLM's extension, what guidellm sends): every chunk carries ``usage`` so
    far (prompt_tokens, completion_tokens generated up to that chunk, total_tokens)."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_obfuscation: StrictBool | None = Field(default=None, description="Accepted and ignored.")


class _Sampling(_Body):
    model: Utf8Str = Field(min_length=1, max_length=200, examples=["demo-lm"])
    max_tokens: StrictInt | None = Field(default=None, ge=1, description="-> max_new_tokens.")
    temperature: RequestFloat | None = Field(
        default=None, ge=0, le=2,
        description="0 = greedy. Default: the model's generation_config.json, else 1 (OpenAI's).",
    )  # fmt: skip
    top_p: RequestFloat | None = Field(default=None, ge=0, le=1, description="0 = the most likely token (greedy).")
    n: StrictInt | None = Field(default=None, description="Must be 1.")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: Utf8Str | list[Utf8Str] | None = Field(default=None, description="Up to 16 stop strings.")
    seed: StrictInt | None = Field(
        default=None, ge=-(2**63), lt=2**63,
        description="Sampling seed, any int64 as OpenAI's (a negative one is taken mod 2**63); default 0.",
    )  # fmt: skip
    frequency_penalty: RequestFloat | None = Field(default=None, description="Only 0 (use repetition_penalty).")
    presence_penalty: RequestFloat | None = Field(default=None, description="Only 0 (use repetition_penalty).")
    logit_bias: dict[Utf8Str, RequestFloat] | None = Field(default=None, description="Not supported (must be empty).")
    user: EndUser | None = Field(
        default=None, description="End-user ID: the sticky key of a canary split (default: the request ID); at most "
        f"{USER_CHARS} characters.",
    )
    # fleet extensions (vLLM names)
    top_k: StrictInt | None = Field(default=None, ge=0, description="Fleet: sample among the top k; 0 = off.")
    repetition_penalty: RequestFloat | None = Field(default=None, description="Fleet: CTRL-style penalty; 1 = off.")
    ignore_eos: StrictBool | None = Field(default=None, description="Fleet: generate past the EOS token.")
    stop_token_ids: list[StrictInt] | None = Field(default=None, description="Fleet: ids that end generation.")


class CompletionBody(_Sampling):
    """``POST /v1/completions``: one prompt (text, or token ids), one choice."""

    prompt: Utf8Str | list[Utf8Str] | list[StrictInt] | list[list[StrictInt]] = Field(
        examples=["Once upon a time"], description="Text, or token ids; a list of one of either is one prompt too."
    )
    echo: StrictBool | None = Field(default=None, description="Not supported (must be false).")
    logprobs: StrictInt | None = Field(default=None, description="Not supported (must be null).")
    best_of: StrictInt | None = Field(default=None, description="Must be 1.")
    suffix: Utf8Str | None = Field(default=None, description="Not supported (must be null).")


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(extra="allow")

    type: Utf8Str
    text: Utf8Str | None = None


class ChatMessage(_Body):
    """One turn of the conversation. The other fields OpenAI defines on a message are declared, so a message
    the SDKs give back (``message.model_dump()``: ``refusal``, ``tool_calls``, … as null) can be sent again;
    :func:`gateway.openai_mapping.chat_messages` refuses those that would carry something the fleet
    cannot render (a tool call, audio, a refusal)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Utf8Str | list[ContentPart] | None = None
    name: Utf8Str | None = None
    tool_call_id: Utf8Str | None = Field(default=None, description="A tool message's call; passed to the template.")
    refusal: Utf8Str | None = Field(default=None, description="Must be null.")
    tool_calls: Annotated[list[Any] | None, UTF8_STRINGS] = Field(default=None, description="Must be null or empty.")
    function_call: Utf8Json = Field(default=None, description="Must be null.")
    audio: Utf8Json = Field(default=None, description="Must be null.")
    annotations: Annotated[list[Any] | None, UTF8_STRINGS] = Field(
        default=None, description="An earlier answer's citations: accepted and ignored (they are not prompt text)."
    )


class ChatBody(_Sampling):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, description="-> max_new_tokens.")
    logprobs: StrictBool | None = Field(default=None, description="Not supported (must be false).")
    top_logprobs: StrictInt | None = Field(default=None, description="Not supported (must be null).")
    tools: Annotated[list[Any] | None, UTF8_STRINGS] = Field(default=None, description="Not supported.")
    tool_choice: Utf8Json = Field(default=None, description="Not supported.")
    parallel_tool_calls: StrictBool | None = Field(default=None, description="Accepted and ignored.")
    response_format: Annotated[dict[str, Any] | None, UTF8_STRINGS] = Field(
        default=None, description="Only {'type': 'text'}."
    )
    # the rest of OpenAI's chat fields: those that change nothing here are accepted and ignored, the others
    # are refused unless empty (gateway.openai_mapping.check_supported), so SDK code that sets them gets an answer
    store: StrictBool | None = Field(default=None, description="Only false: no chat completion is kept to read back.")
    metadata: Metadata | None = Field(
        default=None, description=f"Accepted and ignored (tags of a stored completion; none is stored); at most "
        f"{METADATA_PAIRS} pairs, keys of at most {METADATA_KEY_CHARS} characters, values {METADATA_VALUE_CHARS}.",
    )
    service_tier: Utf8Str | None = Field(default=None, description="Accepted and ignored: one tier.")
    prompt_cache_key: Utf8Str | None = Field(
        default=None, description="Accepted and ignored: prefix reuse is automatic (prefix-aware routing)."
    )
    safety_identifier: Utf8Str | None = Field(default=None, description="Accepted and ignored.")
    modalities: list[Utf8Str] | None = Field(default=None, description="Only ['text'].")
    reasoning_effort: Utf8Str | None = Field(default=None, description="Not supported (must be null).")
    verbosity: Utf8Str | None = Field(default=None, description="Not supported (must be null).")
    prediction: Utf8Json = Field(default=None, description="Not supported (must be null).")
    audio: Utf8Json = Field(default=None, description="Not supported (must be null).")
    web_search_options: Utf8Json = Field(default=None, description="Not supported (must be null).")
    functions: Annotated[list[Any] | None, UTF8_STRINGS] = Field(default=None, description="Not supported.")
    function_call: Utf8Json = Field(default=None, description="Only 'none'.")


class EmbeddingBody(_Body):
    """``POST /v1/embeddings`` (encoder models): one vector per input."""

    model: Utf8Str = Field(min_length=1, max_length=200, examples=["demo-encoder"])
    input: Utf8Str | list[Utf8Str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="A text, texts, token ids, or lists of token ids."
    )
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="'base64': little-endian float32 bytes (the SDKs ask for this)."
    )
    dimensions: StrictInt | None = Field(default=None, description="Not supported (must be null).")
    user: EndUser | None = Field(
        default=None, description="End-user ID: the sticky key of a canary split (default: the request ID); at most "
        f"{USER_CHARS} characters.",
    )


# -- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV the worker took from its prefix cache."""


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = Field(description="stop | length (a deadline is reported as length); None mid-stream.")


class CompletionResponse(BaseModel):
    """A completion, and each chunk of a streamed one (``object`` is the same for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 of little-endian float32.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelObject(BaseModel):
    """OpenAI's model object plus the fleet's view of it (extra keys the SDKs keep as attributes)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="The model file's modification time (unix s); 0 when not on this machine.")
    owned_by: str = "onnx-fleet"
    queue: str
    version: str | None = Field(description="Configured version, else the model card's (None: unknown).")
    served_versions: list[str] = Field(description="Versions that ready workers serve now.")
    ready: bool = Field(description="At least one ready worker serves this model.")
    ready_workers: int
    workers: int
    queue_depth: int
    max_queue_depth: int
    max_input_tokens: int
    max_new_tokens: int


class ModelObjectList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]
