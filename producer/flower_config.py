"""Flower's config file for ``fleet flower`` (``--conf``): shows args and results as JSON.

Flower stores what Celery's events carry: ``args`` is the task's ``argsrepr`` (the fleet's producer
sends JSON, see :mod:`producer.reprs`; another Celery client sends Python's ``repr``), ``result``
is ``saferepr(retval)``, a Python repr capped at 1,024 characters by Celery. Flower calls
:func:`format_task` on a copy of each task before its Tasks table and task page show it, so those
show JSON. Flower's JSON API (``/api/tasks``, ``/api/task/info/<id>``) does not call it: there the
``result`` stays Celery's repr (:func:`as_json` turns it into JSON).

Flower's Tasks table shows only the first ~45 characters of a cell (400 px), so the JSON leads with
what a row is about: the request's ``text`` and ``input_ids``, the result's ``generation``, ``top_k``
or ``embedding``; ``null`` fields, then ``request_id`` (the row's UUID already) and
``schema_version`` go last. Nothing is dropped; JSON objects carry no meaning in their key order.

Flower reads this file with tornado's ``parse_config_file``: it executes it and takes every
top-level name that is also a Flower option as that option's value. ``format_task`` is the only
such name here; keep it so (``tests/unit/test_flower_config.py`` checks).
"""

from __future__ import annotations

import ast
import json
from typing import Any

__all__ = ["LEAD_KEYS", "MAX_PARSED_CHARS", "MAX_SHOWN_CHARS", "TRAIL_KEYS", "as_json", "format_task"]

LEAD_KEYS = ("text", "finish_reason", "input_ids", "input_ids_shown", "generation", "top_k", "embedding")
"""Keys moved to the front of every JSON object shown, in this order."""
TRAIL_KEYS = ("request_id", "schema_version")
"""Keys moved to the end."""

MAX_SHOWN_CHARS = 2_000
"""Characters of one field shown; a longer one is cut and ends with ``…``."""
MAX_PARSED_CHARS = 100_000
"""Longest repr parsed with ``ast.literal_eval`` (Flower formats every row on every refresh)."""


def as_json(shown: str | None, max_chars: int = MAX_SHOWN_CHARS) -> str | None:
    """``shown`` (a JSON or Python-literal repr) as JSON text, cut to ``max_chars`` characters.

    JSON and Python literals (``{'a': None}`` becomes ``{"a": null}``) are dumped again with
    :data:`LEAD_KEYS` first and :data:`TRAIL_KEYS` last in each object; anything else
    (a repr Celery cut short with ``...``, an object's ``<repr>``, ``-inf``) stays as it is. ``None``
    and ``""`` stay. Never raises.
    """
    if not shown:
        return shown
    return _cut(_json_text(shown), max_chars)


def format_task(task: Any) -> Any:
    """Flower's ``format_task`` hook: the task (a copy) with ``args``, ``kwargs``, ``result`` as JSON."""
    for field in ("args", "kwargs", "result"):
        value = getattr(task, field, None)
        if isinstance(value, str):
            setattr(task, field, as_json(value))
    return task


def _json_text(shown: str) -> str:
    if len(shown) > MAX_PARSED_CHARS:
        return shown
    try:
        try:
            value = json.loads(shown)
        except ValueError:
            value = ast.literal_eval(shown)
        return json.dumps(_lead(value), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return shown


def _lead(value: Any) -> Any:
    """``value`` with each dict's keys in display order: :data:`LEAD_KEYS`, the others, the ``null``
    ones (outputs a request did not ask for), :data:`TRAIL_KEYS`."""
    if isinstance(value, list | tuple):
        return [_lead(item) for item in value]
    if not isinstance(value, dict):
        return value

    def rank(key: Any) -> tuple[int, int]:
        if key in TRAIL_KEYS:
            return 3, TRAIL_KEYS.index(key)
        if value[key] is None:
            return 2, 0
        if key in LEAD_KEYS:
            return 0, LEAD_KEYS.index(key)
        return 1, 0

    return {key: _lead(value[key]) for key in sorted(value, key=rank)}


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def mask_broker_urls() -> None:
    """Give Flower's Celery app (the default one: ``fleet flower`` runs ``celery flower`` without ``-A``)
    the fleet's connection class, so its "Broker: <URL>" line masks a password only where the URL has
    one (kombu's own writes ``redis://:**@host`` either way): :class:`protocol.redis_conn.MaskedConnection`."""
    from celery import current_app

    from protocol.redis_conn import MaskedConnection

    current_app.amqp.Connection = MaskedConnection


if "__spec__" not in globals():  # executed as Flower's --conf file (tornado's parse_config_file), not imported
    mask_broker_urls()
