"""What a client knows of each model: its card and tokenizer, and text turned into that model's tokens.

:class:`ModelCards` is the part of :class:`producer.client.FleetClient` that learns a model's card from the
model's file (with its tokenizer), else from the card its workers published in Redis, and keeps it; a card
found nowhere is looked for again :data:`CARD_MISS_TTL_S` later. :func:`tokenized_part` bounds a text by the
most characters ``limits.max_input_tokens`` tokens could cover, before any memory is spent tokenizing it.
"""

from __future__ import annotations

from collections.abc import Callable

import redis

from protocol.errors import InputTooLong, InvalidRequest
from protocol.keys import CARD_KEY
from protocol.modelcard import ModelCard, load_card
from protocol.settings import FleetSettings, LimitSettings
from protocol.tokenization import Tokenizer, load_tokenizer

__all__ = ["CARD_MISS_TTL_S", "NORMALIZATION_ROOM", "SPECIAL_TOKENS_ROOM", "ModelCards", "ModelInfo", "tokenized_part"]


SPECIAL_TOKENS_ROOM = 8
"""Tokens allowed for what a tokenizer adds (BOS, ``[CLS]``/``[SEP]``) when bounding a text by its length."""
NORMALIZATION_ROOM = 2
"""How many times longer a text may be than its tokens could cover, for normalizers that shrink it
(accents stripped, NFKC, control characters removed) before it is tokenized."""

CARD_MISS_TTL_S = 5.0
"""How long a client goes on without a model's card it found neither in the model's file nor in Redis before it
reads Redis again (s): a service started before the model's workers learns the card they publish this much
later at most, and meanwhile costs no Redis read per request. A card that was found is kept."""


class ModelInfo:
    """A model's card and tokenizer as a client found them (either may be None), and when it looked."""

    def __init__(self, card: ModelCard | None, tokenizer: Tokenizer | None, read_s: float) -> None:
        self.card = card
        self.tokenizer = tokenizer
        self.read_s = read_s
        """When the card was looked for (``time.monotonic()`` s)."""

    def fresh(self, now_s: float) -> bool:
        """Whether to use this as it is: a card was found, or the miss is younger than :data:`CARD_MISS_TTL_S`."""
        return self.card is not None or now_s - self.read_s < CARD_MISS_TTL_S


def tokenized_part(text: str, tokenizer: Tokenizer, limits: LimitSettings) -> str:
    """The part of ``text`` worth tokenizing: all of it, unless it is longer than any text that
    fits ``limits.max_input_tokens`` could be. Tokenizing costs memory per token (~100 bytes each
    in Hugging Face tokenizers: 16 texts of 1 MiB took a gateway to 1.8 GB), so such a text is
    refused before it is tokenized (``truncate: none``), or cut to the end that truncation keeps
    (``left``: its end, ``right``: its start) with room to spare, which leaves the kept tokens as
    they were.

    Raises:
        InputTooLong: ``truncate`` is ``none`` and ``text`` must have more tokens than the limit.
    """
    per_token = getattr(tokenizer, "max_token_chars", None)
    if not isinstance(per_token, int) or per_token < 1:  # a tokenizer that cannot say: tokenize it all
        return text
    window = (limits.max_input_tokens + SPECIAL_TOKENS_ROOM) * per_token * NORMALIZATION_ROOM
    if len(text) <= window:
        return text
    if limits.truncate == "none":
        cap = limits.max_input_tokens
        raise InputTooLong(
            f"text has {len(text)} characters, more than {cap} tokens of this tokenizer can hold (a token "
            f"covers at most {per_token} characters); the limit is max_input_tokens={cap}",
            "text",
            cap,
        )
    return text[-window:] if limits.truncate == "left" else text[:window]


class ModelCards:
    """Each configured model's card and tokenizer, looked up once and kept (a miss for :data:`CARD_MISS_TTL_S`)."""

    redis: redis.Redis[bytes]
    settings: FleetSettings
    monotonic: Callable[[], float]
    _models: dict[str, ModelInfo]

    def _model(self, model: str) -> tuple[str, ModelInfo]:
        """``model``'s key and what this client knows of it: the card and tokenizer of its file, else the card its
        workers published in Redis; a miss is looked for again after :data:`CARD_MISS_TTL_S`."""
        key = self.settings.model_key(model)
        info = self._models.get(key)
        now_s = self.monotonic()
        if info is None or not info.fresh(now_s):
            card: ModelCard | None = None
            tokenizer: Tokenizer | None = None
            path = self.settings.models[key].path
            if path.exists():
                card = load_card(path)
                tokenizer = load_tokenizer(card, path.parent)
            else:
                raw = self.redis.get(CARD_KEY.format(model=key))
                if raw:
                    card = ModelCard.model_validate_json(raw)
                    if card.tokenizer == "byte":
                        tokenizer = load_tokenizer(card, path.parent)
            info = self._models[key] = ModelInfo(card, tokenizer, now_s)
        return key, info

    def model_loaded(self, model: str) -> bool:
        """True when ``model``'s card and tokenizer are already in memory (building a request for it then
        reads no file and no Redis key: safe on an event loop).

        Raises:
            UnknownModel: ``model`` is not configured.
        """
        info = self._models.get(self.settings.model_key(model))
        return info is not None and info.fresh(self.monotonic())

    def model_card(self, model: str) -> ModelCard | None:
        """``model``'s card as this client knows it (its file's, else the one its workers published in
        Redis); None when neither is available here (Redis is read again :data:`CARD_MISS_TTL_S` later)."""
        return self._model(model)[1].card

    def tokenize(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` with the model's own tokenizer; ``add_special_tokens=False`` for text
        that already holds them (a rendered chat template: see :meth:`Tokenizer.encode`).

        Raises:
            InvalidRequest: the model's tokenizer is not available on this machine.
            InputTooLong: ``text`` is longer than ``max_input_tokens`` tokens could cover and the model's
                ``truncate`` is ``none`` (see :func:`tokenized_part`).
        """
        _, info = self._model(model)
        if info.tokenizer is None:
            why = (
                "has no tokenizer (its card says tokenizer 'none')"
                if info.card is not None and info.card.tokenizer == "none"
                else "has no card here: its path does not exist on this machine and no worker has published its "
                "card (build it with `fleet build-model`, fix models.<m>.path, or wait for a worker)"
                if info.card is None
                else "has no tokenizer on this machine"
            )
            raise InvalidRequest(f"model {model!r} {why}: send input_ids (--tokens on the CLI)", "text", None)
        limits = self.settings.models[self.settings.model_key(model)].limits
        text = tokenized_part(text, info.tokenizer, limits)
        return info.tokenizer.encode(text, add_special_tokens=add_special_tokens)
