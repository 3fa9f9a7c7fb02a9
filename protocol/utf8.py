"""Caller strings that can be written as UTF-8, checked where a body is parsed.

JSON can carry a lone surrogate (``"\\ud800"``, half of a pair without the other half); Python decodes it
into a ``str`` that no UTF-8 text can hold, so it breaks whatever later encodes it: a Redis key or
value, a sha256 of a routing key, a stored response served back as JSON (HTTP 500 for every later
read). Every caller string a face stores, echoes, hashes or logs is therefore refused at the edge:

* :data:`Utf8Str` — a strict ``str`` (JSON string) without lone surrogates. It checks before any length
  or pattern constraint, so the error is always this one, naming the field and the character.
* :data:`Utf8Json` — any JSON value (an ``Any`` field: ``tools``, ``response_format``, …) whose strings,
  keys included, are all UTF-8; the error says where inside the value (:data:`UTF8_STRINGS`: the same
  check on a type of its own, e.g. ``dict[str, Any]``).

Both raise pydantic's ``string_unicode`` error (:data:`ERROR_TYPE`) with :func:`surrogate_message`.
What was stored before these checks existed is read back through :func:`mend_surrogates`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import BeforeValidator, StrictStr, ValidationInfo
from pydantic_core import PydanticCustomError

__all__ = ["ERROR_TYPE", "UTF8_STRINGS", "Utf8Json", "Utf8Str", "first_surrogate", "mend_surrogates",
           "surrogate_message"]

ERROR_TYPE = "string_unicode"
"""The pydantic error type of a string that is not valid Unicode."""


def first_surrogate(text: str) -> int | None:
    """The index of ``text``'s first lone surrogate (U+D800–U+DFFF), or None when it encodes as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def surrogate_message(text: str, at: int) -> str:
    """Why ``text`` (whose character ``at`` is a lone surrogate) is refused, without the character itself."""
    return (
        f"not valid Unicode: lone surrogate U+{ord(text[at]):04X} at character {at} "
        "(a \\uD800-\\uDFFF escape must be half of a surrogate pair)"
    )


def mend_surrogates(value: Any) -> Any:
    """A JSON value with every lone surrogate in its strings (keys included) replaced by U+FFFD; ``value``
    itself when it has none. For documents stored before the edge refused them: served back as they are,
    they could not be encoded (HTTP 500 on every read until they expired)."""
    if isinstance(value, str):
        if first_surrogate(value) is None:
            return value
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {mend_surrogates(k): mend_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mend_surrogates(item) for item in value]
    return value


def _utf8(value: Any) -> Any:
    """``value`` as given; a str with a lone surrogate is refused (anything else is the str type's to judge)."""
    if isinstance(value, str) and (at := first_surrogate(value)) is not None:
        raise PydanticCustomError(ERROR_TYPE, surrogate_message(value, at))
    return value


Utf8Str = Annotated[StrictStr, BeforeValidator(_utf8)]
"""A JSON string that encodes as UTF-8 (see the module docstring); constraints in ``Field`` apply after."""


def _strings(value: Any, path: str) -> Iterator[tuple[str, str, bool]]:
    """Every str inside a JSON value: ``(where, text, is_key)``, ``where`` as the caller writes it."""
    if isinstance(value, str):
        yield path, value, False
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield path, key, True
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]")


def _utf8_json(value: Any, info: ValidationInfo) -> Any:
    for where, text, is_key in _strings(value, info.field_name or "value"):
        at = first_surrogate(text)
        if at is not None:
            what = f"a key of {where}" if is_key else where
            raise PydanticCustomError(ERROR_TYPE, f"{what} is {surrogate_message(text, at)}")
    return value


UTF8_STRINGS = BeforeValidator(_utf8_json)
"""The check of :data:`Utf8Json` on a JSON type of its own: ``Annotated[dict[str, Any] | None, UTF8_STRINGS]``."""

Utf8Json = Annotated[Any, UTF8_STRINGS]
"""Any JSON value whose strings and keys all encode as UTF-8; the error names the place inside it."""
