"""Model-dependent request checks, run by the producer before queueing and by the worker again.

Pure functions: no I/O, so the client, the gateway and the worker apply the very same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import EmptyInput, InputTooLong, InvalidRequest, TokenOutOfRange
from protocol.messages import GenerationParams, OutputKind, OutputSpec
from protocol.modelcard import ModelKind
from protocol.settings import LimitSettings

__all__ = ["CheckedInput", "check_generation_room", "check_input", "input_token_limit", "resolve_output"]


@dataclass(frozen=True)
class CheckedInput:
    """Ids that passed every limit, possibly truncated."""

    input_ids: list[int]
    truncated: bool


def check_input(
    input_ids: list[int], *, limits: LimitSettings, vocab_size: int, max_positions: int | None = None
) -> CheckedInput:
    """Validate (and, when ``limits.truncate`` says so, truncate) one request's ids.

    The length limit is ``limits.max_input_tokens``, or the model card's ``max_positions`` (tokens) where that is
    smaller: a model given more positions than it has fails inside ONNX Runtime (an out-of-range position
    embedding), with no field named, and counts as a failed engine run.

    Raises:
        EmptyInput: no ids.
        InputTooLong: more ids than the limit and ``truncate`` is ``'none'``.
        TokenOutOfRange: an id outside ``[0, vocab_size)``; names its position.
    """
    if not input_ids:
        raise EmptyInput("input_ids is empty: a request needs at least 1 token", "input_ids", 1)
    truncated = False
    cap = input_token_limit(limits, max_positions)
    if len(input_ids) > cap:
        if limits.truncate == "none":
            raise InputTooLong(f"input_ids has {len(input_ids)} tokens; the limit is {_named_limit(limits, cap)}",
                               "input_ids", cap)  # fmt: skip
        input_ids = input_ids[-cap:] if limits.truncate == "left" else input_ids[:cap]
        truncated = True
    for pos, token in enumerate(input_ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequest(
                f"input_ids[{pos}] is {token!r}, not an integer", f"input_ids[{pos}]", "integer"
            )
        if not 0 <= token < vocab_size:
            raise TokenOutOfRange(
                f"input_ids[{pos}] = {token} is outside the vocabulary [0, {vocab_size})",
                f"input_ids[{pos}]",
                vocab_size,
            )
    return CheckedInput(list(input_ids), truncated)


def input_token_limit(limits: LimitSettings, max_positions: int | None) -> int:
    """The most tokens one request may carry (tokens): ``limits.max_input_tokens``, capped by the model's
    ``max_positions`` when it is known (None: not known here)."""
    return limits.max_input_tokens if max_positions is None else min(limits.max_input_tokens, max_positions)


def _named_limit(limits: LimitSettings, cap: int) -> str:
    """How an InputTooLong names its limit ``cap``: the setting, or the model's positions where they are fewer."""
    if cap == limits.max_input_tokens:
        return f"max_input_tokens={cap}"
    return f"{cap}, the model's max_positions (limits.max_input_tokens={limits.max_input_tokens} is above it)"


def resolve_output(
    spec: OutputSpec, *, model_kind: ModelKind, limits: LimitSettings, vocab_size: int | None = None
) -> OutputSpec:
    """The output the model will produce for ``spec``; fills the default kind.

    Raises:
        InvalidRequest: the kind does not fit the model, top_k exceeds ``limits.max_top_k``, or (given
            ``vocab_size``) a stop token id is outside ``[0, vocab_size)``.
    """
    offered: tuple[OutputKind, ...] = ("next_token", "generate") if model_kind == "causal_lm" else ("embedding",)
    kind = spec.kind or ("generate" if spec.generation is not None else offered[0])
    if kind not in offered:
        raise InvalidRequest(
            f"output.kind {kind!r} is not available: {'an' if model_kind[0] in 'aeiou' else 'a'} {model_kind} model "
            f"produces {' or '.join(map(repr, offered))}",
            "output.kind",
            list(offered),
        )
    if spec.generation is not None and kind != "generate":
        raise InvalidRequest(
            f"output.generation is only for output.kind 'generate', not {kind!r}", "output.generation", "generate"
        )
    if kind == "generate":
        params = spec.generation or GenerationParams()
        if params.max_new_tokens > limits.max_new_tokens:
            raise InvalidRequest(
                f"output.generation.max_new_tokens = {params.max_new_tokens} exceeds the limit "
                f"max_new_tokens={limits.max_new_tokens}",
                "output.generation.max_new_tokens",
                limits.max_new_tokens,
            )
        for pos, token in enumerate(params.stop_token_ids):
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise TokenOutOfRange(
                    f"output.generation.stop_token_ids[{pos}] = {token} is outside the vocabulary [0, {vocab_size})",
                    f"output.generation.stop_token_ids[{pos}]",
                    vocab_size,
                )
        return spec.model_copy(update={"kind": kind, "generation": params})
    if kind == "next_token" and spec.top_k > limits.max_top_k:
        raise InvalidRequest(
            f"output.top_k = {spec.top_k} exceeds the limit max_top_k={limits.max_top_k}",
            "output.top_k",
            limits.max_top_k,
        )
    return spec.model_copy(update={"kind": kind})


def check_generation_room(prompt_tokens: int, max_new_tokens: int, *, max_positions: int, max_kv_tokens: int) -> None:
    """A generation of ``max_new_tokens`` after a prompt of ``prompt_tokens`` fits the model's positions
    (``max_positions``, the card's) and the worker's KV budget (``max_kv_tokens`` tokens).

    Raises:
        InvalidRequest: naming ``output.generation.max_new_tokens`` with the most that fits as its limit; or,
            where the prompt leaves no room for one generated token, naming ``input_ids`` (the prompt is what
            must change) with the longest prompt that leaves room for one as its limit.
    """
    total = prompt_tokens + max_new_tokens
    for bound, what in ((max_positions, "the model's max_positions"), (max_kv_tokens, "the worker's KV budget "
                                                                                       "max_kv_tokens")):
        if total > bound:
            room = max(0, bound - prompt_tokens)
            hint = (f"at most {room} fit" if room else
                    f"the prompt leaves no room for one: it must be shorter than {bound} tokens")  # fmt: skip
            field = "output.generation.max_new_tokens" if room else "input_ids"
            # the model's context: InputTooLong (OpenAI's context_length_exceeded, which clients test to trim and
            # retry); the worker's KV budget is a capacity of the fleet's, not of the model. The message names the
            # field in full, so a face that calls it otherwise (max_tokens) renames it there too
            error = InputTooLong if bound == max_positions else InvalidRequest
            raise error(f"prompt ({prompt_tokens} tokens) + output.generation.max_new_tokens ({max_new_tokens}) = "
                        f"{total} exceeds {what}={bound}: {hint}", field, room if room else bound - 1)

