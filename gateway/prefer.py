"""The ``Prefer`` request header (RFC 7240): the ``wait`` preference a submit honours.

``Prefer: wait=10`` asks the server to answer within 10 seconds, with the finished result if it has
one by then (RFC 7240 section 4.3; job APIs such as Replicate's use it on "create"). Preferences are
hints: an unknown one, or one that cannot be read, is ignored, never refused. The value is read as
:func:`gateway.plain_numbers.plain_seconds` reads it: ASCII digits with an optional decimal fraction (``wait=1_0``,
``wait=1e1``, ``wait=inf`` cannot be read, so they are ignored; ``float()`` read the first two as 10).
"""

from __future__ import annotations

from gateway.plain_numbers import plain_seconds

__all__ = ["prefer_wait_s"]

_OWS = " \t"
"""HTTP's optional whitespace (RFC 9110 section 5.6.3): a space or a tab, nothing else ``str.strip()`` drops."""


def prefer_wait_s(header: str | None) -> float | None:
    """The ``wait`` preference of a ``Prefer`` header value, in seconds; None when absent or unreadable.

    Several preferences may be comma-separated, each with ``;``-separated parameters; the name is
    case-insensitive and the value may be quoted. ``wait=0`` is 0.0 (answer at once).
    """
    if not header:
        return None
    for preference in header.split(","):
        name, _, value = preference.split(";", 1)[0].partition("=")
        if name.strip(_OWS).lower() != "wait":
            continue
        value = value.strip(_OWS)
        if len(value) >= 2 and value[0] == value[-1] == '"':  # a quoted-string: one pair of quotes
            value = value[1:-1]
        return plain_seconds(value)
    return None
