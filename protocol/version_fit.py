"""Whether a model version's card fits the model it serves under (pure: two cards in, a verdict out).

A model's versions share one face: producers and the gateway tokenize, validate ids and cap
generations with the *model's* card (the configured file's, see :func:`store.cards.reference_card`),
and every version behind ``fleet.<m>`` and ``fleet.<m>.canary`` must answer those requests the way
the stable one does. So a version must have, compared with the model's card:

* the same ``kind``: a causal LM answers next-token / generate requests, an encoder embeddings; an
  encoder behind a causal LM's queue answers ``next_token`` requests with an ``embedding`` (and
  generations fail), without an error the canary guard could count;
* the same ``vocab_size``: producers accept ids in ``[0, vocab_size)`` of the model's card; a smaller
  vocabulary fails ids the stable version takes, a larger one returns logits (top-k ids) the model's
  tokenizer cannot decode;
* ``max_positions`` no smaller than the model's: producers size inputs and cap generations by it, a
  shorter context refuses what the stable version accepts (a longer one is a compatible upgrade). How
  much longer is not for two cards to say: the version's graph bounds it (its position table's rows),
  and ``push`` refuses a card above that bound (:mod:`store.graph_fit`), since workers reserve each KV
  slot for the card's ``max_positions``;
* for a causal LM, the same KV layout (``num_layers``, KV heads, ``head_dim``): the worker's KV budget
  (``batching.max_kv_tokens``, the decode slots) is set in tokens for the model's per-token KV size,
  which the layout fixes; a different layout is another architecture that may run out of memory where
  the stable one does not (a version without KV layers cannot generate at all);
* for an encoder, the same ``hidden_size``: the length of every embedding it returns.

Not compared: weights, quantization and precision (what versions are for), the tokenizer file's
contents (the card only names it; ``vocab_size`` stands in), the special token ids, ``parameters``.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import IncompatibleVersion
from protocol.modelcard import ModelCard

__all__ = ["Mismatch", "incompatibility", "mismatches"]

RULE = ("a version must have its model's kind, vocab_size and KV layout (num_layers, kv_heads, head_dim; an "
        "encoder: hidden_size) and at least its max_positions")
"""The rule, as the refusal states it."""

_OUTPUT = {"causal_lm": "next tokens", "encoder": "embeddings"}


@dataclass(frozen=True)
class Mismatch:
    """One card field where the version differs from its model: what the version has, what it needs."""

    field: str
    version_value: int | str
    model_value: int | str
    at_least: bool = False
    """The version needs at least ``model_value`` (not exactly it)."""

    def describe(self) -> str:
        """``vocab_size 1024 (the model's: 512)``."""
        need = "at least " if self.at_least else ""
        return f"{self.field} {self.version_value} (the model's: {need}{self.model_value})"


def mismatches(model_card: ModelCard, version_card: ModelCard) -> list[Mismatch]:
    """Where ``version_card`` breaks the rule of the module docstring against ``model_card``; [] = fits.

    A different kind is reported alone: the other fields mean different things for each kind.
    """
    if version_card.kind != model_card.kind:
        return [Mismatch("kind", version_card.kind, model_card.kind)]
    pairs: list[tuple[str, int, int]] = [("vocab_size", version_card.vocab_size, model_card.vocab_size)]
    if model_card.kind == "causal_lm":
        pairs += [("num_layers", version_card.num_layers, model_card.num_layers),
                  ("kv_heads", version_card.kv_heads, model_card.kv_heads),
                  ("head_dim", version_card.head_dim, model_card.head_dim)]
    else:
        pairs.append(("hidden_size", version_card.hidden_size, model_card.hidden_size))
    found = [Mismatch(name, got, want) for name, got, want in pairs if got != want]
    if version_card.max_positions < model_card.max_positions:
        found.append(Mismatch("max_positions", version_card.max_positions, model_card.max_positions, at_least=True))
    return found


def incompatibility(
    model: str, version: str, model_card: ModelCard, version_card: ModelCard
) -> IncompatibleVersion | None:
    """The error refusing ``model`` ``version`` (one line: the model, the version, every mismatch, the
    rule), or None when the version fits. The caller raises it."""
    found = mismatches(model_card, version_card)
    if not found:
        return None
    if found[0].field == "kind":
        kind = version_card.kind
        message = (f"{model} {version} is {_article(kind)} {kind} model ({_OUTPUT[kind]}); {model} is "
                   f"{_article(model_card.kind)} {model_card.kind}: {RULE}")
    else:
        message = (f"{model} {version} does not fit {model}: " + "; ".join(m.describe() for m in found)
                   + f": {RULE}")
    return IncompatibleVersion(message, found[0].field, found[0].model_value)


def _article(kind: str) -> str:
    return "an" if kind == "encoder" else "a"
