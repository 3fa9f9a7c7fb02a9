"""The ``Prefer`` request header (RFC 7240): the ``wait`` preference a submit honours.

``Prefer: wait=10`` asks the server to answer within 10 seconds, with the finished result if it has
one by then (RFC 7240 section 4.3; job APIs such as Replicate's use it on "create"). Preferences are
hints: an unknown one, or one that cannot be read, is ignored, never refused.
"""

from __future__ import annotations

import math

__all__ = ["prefer_wait_s"]


def prefer_wait_s(header: str | None) -> float | None:
    """The ``wait`` preference of a ``Prefer`` header value, in seconds; None when absent or unreadable.

    Several preferences may be comma-separated, each with ``;``-separated parameters; the name is
    case-insensitive and the value may be quoted. ``wait=0`` is 0.0 (answer at once).
    """
    if not header:
        return None
    for preference in header.split(","):
        name, _, value = preference.split(";", 1)[0].partition("=")
        if name.strip().lower() != "wait":
            continue
        try:
            seconds = float(value.strip().strip('"'))
        except ValueError:
            return None
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    return None
