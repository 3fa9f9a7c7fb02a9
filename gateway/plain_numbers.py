"""Numbers a caller writes in a query string or a header, read as ASCII digits only.

``float()``, ``int()`` and pydantic's lax parsing of a string read more than a caller means: ``1_0`` (10),
``١٠`` (Arabic-Indic digits, 10), `` 1e1``, ``+5``, ``-0``, ``inf``, ``nan``. A proxy, a log reader or another
parser may read such a value otherwise, or not at all, so the gateway reads only:

* seconds (``wait_s``, ``Prefer: wait``): ``1*DIGIT ["." 1*DIGIT]`` (``10``, ``2.5``; RFC 7240's
  ``delta-seconds``, with a decimal fraction);
* counts (``limit``, ``Content-Length``): ``1*DIGIT``.

:data:`DIGIT_SECONDS` and :data:`DIGIT_COUNT` check a query parameter's string before pydantic reads it (a value of
another form is a 422 naming the parameter): put them after the ``Query(...)``, so its bounds stay JSON Schema's
``minimum``/``maximum`` in ``/openapi.json``. :func:`plain_seconds` reads a header's value (None when it is not of
that form).
"""

from __future__ import annotations

import re

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

__all__ = ["DIGIT_COUNT", "DIGIT_SECONDS", "is_plain_count", "plain_seconds"]

_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_COUNT = re.compile(r"[0-9]+")


def plain_seconds(text: str) -> float | None:
    """``text`` (``10``, ``2.5``) in seconds; None when it is not ASCII digits with an optional decimal fraction."""
    return float(text) if _SECONDS.fullmatch(text) else None


def is_plain_count(text: str | bytes) -> bool:
    """Whether ``text`` is ASCII digits only (what ``int()`` should be given: it reads ``1_0``, ``+5``, `` 5``)."""
    return _COUNT.fullmatch(text.decode("latin-1") if isinstance(text, bytes) else text) is not None


def _seconds(value: object) -> object:
    if isinstance(value, str) and plain_seconds(value) is None:
        raise PydanticCustomError("float_parsing", "{value} is not a number of seconds: digits with an optional "
                                  "decimal fraction, e.g. 10 or 2.5", {"value": repr(value[:40])})  # fmt: skip
    return value


def _count(value: object) -> object:
    if isinstance(value, str) and not is_plain_count(value):
        raise PydanticCustomError("int_parsing", "{value} is not a whole number: digits only, e.g. 20",
                                  {"value": repr(value[:40])})  # fmt: skip
    return value


DIGIT_SECONDS = BeforeValidator(_seconds)
"""``Annotated[float | None, Query(...), DIGIT_SECONDS]``: a query parameter in seconds, as :func:`plain_seconds`
reads it."""
DIGIT_COUNT = BeforeValidator(_count)
"""``Annotated[int, Query(...), DIGIT_COUNT]``: a query parameter that counts, in ASCII digits."""
