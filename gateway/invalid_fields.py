"""What a body that failed validation gets told: the field as the caller sent it, and why.

Pydantic locates an error by a path that is not quite the caller's: it starts with where the value came
from (``body``, ``query``, ``path``), writes list indexes as path parts (``messages.0.content``), and for a
field that takes several forms (``prompt``: a string, strings, token ids, lists of token ids) adds the
form it tried (``prompt.str``) and reports one error per form. :func:`describe` turns that into the
caller's path (``messages[0].content``) and one message: the error inside the one form the value took,
when exactly one form got past its outer type (a list of content parts with a bad part) or only one form
failed on something other than a type mismatch (a string that is not valid Unicode), else the forms the
field accepts. A dict's bad key is named by the dict (``metadata``): pydantic writes the key lossily.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["caller_path", "describe"]

_SOURCES = frozenset({"body", "query", "path", "header", "cookie"})
"""Where FastAPI says a value came from: the first part of its error paths, not a field."""
_PLAIN_FORMS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "bytes"})
_KEY = "[key]"
"""Pydantic's last path part for an error in a dict's key (the part before it is the key)."""
_VALIDATED = re.compile(r"function-(?:before|after|wrap|plain)\[[^\[\](),]*\(\), ([^\]]*)\]")
"""How pydantic tags a form checked by a validator (``function-before[_utf8(), str]``): the type is the form."""


def _form_name(tag: str) -> str:
    """A union's form as the caller knows it: ``list[function-before[_utf8(), str]]`` → ``list[str]``."""
    while (plain := _VALIDATED.sub(r"\1", tag)) != tag:
        tag = plain
    return tag


def caller_path(parts: Sequence[Any]) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _loc(error: Mapping[str, Any]) -> tuple[Any, ...]:
    loc = tuple(error.get("loc", ()))
    return loc[1:] if loc and loc[0] in _SOURCES and len(loc) > 1 else loc


def _form_at(errors: list[tuple[tuple[Any, ...], Mapping[str, Any]]], loc: tuple[Any, ...]) -> int | None:
    """The first position of ``loc`` that names a form of a union rather than a field: a type's name
    (``str``, ``list[int]``), or a part that differs among errors that share the path before it."""
    for i, part in enumerate(loc):
        if not isinstance(part, str) or part == _KEY or loc[i + 1 : i + 2] == (_KEY,):  # a dict's key is data
            continue
        if "[" in part or part in _PLAIN_FORMS:
            return i
        siblings = {other[i] for other, _ in errors if len(other) > i and other[:i] == loc[:i]}
        if len(siblings) > 1 and part[:1].isupper():  # a model's class name as the form's tag
            return i
    return None


def describe(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The field (the caller's path; ``body`` for the body as a whole) and the message for the first of
    ``errors`` (FastAPI's ``RequestValidationError.errors()``); :func:`protocol.messages.limit_of` of the
    first error gives the bound it broke."""
    located = [(_loc(e), e) for e in errors]
    if not located:
        return "body", "invalid field body: invalid request"
    return _describe(located, len(located))


def _took(errors: list[tuple[tuple[Any, ...], Mapping[str, Any]]]) -> bool:
    """Whether the value had a form's type and broke something else (a ``string_unicode``, a length): none of
    the form's errors is a type mismatch (``string_type``, ``list_type``, …)."""
    return all(not str(error.get("type", "")).endswith("_type") for _, error in errors)


def _describe(located: list[tuple[tuple[Any, ...], Mapping[str, Any]]], total: int) -> tuple[str, str]:
    loc, first = located[0]
    at = _form_at(located, loc)
    if at is None:
        key = len(loc) >= 2 and loc[-1] == _KEY  # a dict's key: pydantic writes it lossily, so name the dict
        field = caller_path(loc[:-2] if key else loc) or "body"
        more = f" (and {total - 1} more errors)" if total > 1 else ""
        what = f"{field} (a key)" if key else field
        return field, f"invalid field {what}: {first.get('msg', 'invalid value')}{more}"
    base = loc[:at]
    forms: dict[str, list[tuple[tuple[Any, ...], Mapping[str, Any]]]] = {}
    for other, error in located:
        if len(other) > at and other[:at] == base:
            forms.setdefault(str(other[at]), []).append((other[:at] + other[at + 1 :], error))
    inside = [form for form, errs in forms.items() if any(len(other) > at for other, _ in errs)]
    if len(inside) != 1:  # else: the value took the one form whose type holds no mismatch (a string, but no Unicode)
        inside = [form for form in (inside or forms) if _took(forms[form])]
    if len(inside) == 1:  # the value took this form's outer type: what is wrong is inside it
        return _describe(forms[inside[0]], len(forms[inside[0]]))
    field = caller_path(base) or "body"
    accepted = ", ".join(_form_name(form) for form in forms)
    return field, f"invalid field {field}: the value matches none of its accepted forms ({accepted})"
