"""Checks of the arguments callers hand ``FleetClient``: each wrong type or value becomes
:class:`~protocol.errors.InvalidRequest` naming the argument, never a raw ``TypeError``/``AttributeError``
from deeper down, nor a silent reinterpretation (bytes read as token ids, a string as a list of inputs).

Integral numbers of any type (numpy's ``int64``/``int32`` scalars and arrays, what a tokenizer's
``return_tensors="np"`` gives) are accepted where an integer is asked for and sent as plain ``int``;
``bool`` and floats are not integers here. Pure functions: no I/O.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from protocol.errors import InvalidRequest

__all__ = [
    "checked_inputs",
    "checked_request_id",
    "checked_request_ids",
    "checked_str",
    "integer",
    "labelled",
    "plain_numbers",
    "poll_interval_s",
    "seconds_limit",
    "token_ids",
]

T = TypeVar("T")


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def checked_str(value: Any, field: str, *, optional: bool = True) -> str | None:
    """``value`` when it is a string (or None, when ``optional``).

    Raises:
        InvalidRequest: naming ``field``.
    """
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{field} must be a string, not {_shown(value)}", field, "string")
    return value


def integer(value: Any, field: str) -> int:
    """``value`` as a plain ``int``: any integral number (``operator.index``: numpy integers too), not a bool.

    Raises:
        InvalidRequest: naming ``field`` (a float, a bool, a string, ...).
    """
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InvalidRequest(f"{field} is {value!r}, not an integer", field, "integer")


def token_ids(value: Any, field: str = "input_ids") -> list[int]:
    """Token ids as a list of plain ``int`` (a list, tuple, range or numpy array of integers).

    Raises:
        InvalidRequest: a string or bytes (text goes in ``text=``), a mapping or a non-iterable (named
            ``field``), or an id that is not an integer (named ``field[i]``).
    """
    if isinstance(value, str | bytes | bytearray | memoryview):
        raise InvalidRequest(f"{field} must be a sequence of token ids, not {type(value).__name__}: send "
                             "text as text=... (a str), which the model's tokenizer turns into ids", field, None)
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise InvalidRequest(f"{field} must be a sequence of token ids, not {_shown(value)}", field, None)
    return [t if type(t) is int else integer(t, f"{field}[{pos}]") for pos, t in enumerate(value)]


def plain_numbers(value: Any) -> Any:
    """``value`` with numpy scalars and arrays inside it (at any depth of dicts, lists, tuples) turned into
    Python numbers and lists, which pydantic's fields and JSON take; anything else as it is."""
    if isinstance(value, Mapping):
        return {k: plain_numbers(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_numbers(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy's ndarray and scalar types
    if callable(tolist) and not isinstance(value, str | bytes | bytearray):
        return tolist()
    return value


def checked_inputs(inputs: Any) -> Iterable[Any]:
    """The inputs of a batch call (``submit_many``, ``submit_bulk``): an iterable of id sequences or texts.

    Raises:
        InvalidRequest: ``inputs`` is a string or bytes (it would be read one character each), a mapping or
            not iterable; named ``inputs``.
    """
    if isinstance(inputs, str | bytes | bytearray | memoryview | Mapping) or not isinstance(inputs, Iterable):
        raise InvalidRequest(f"inputs must be an iterable of inputs (each a list of token ids or a text), not "
                             f"{_shown(inputs)}: wrap one input in a list", "inputs", None)  # fmt: skip
    return inputs


def labelled(items: Iterable[T], build: Callable[[T], Any], label: Callable[[int], str]) -> list[Any]:
    """``build(item)`` for each item, in order; an InvalidRequest is raised again (same class) under
    ``label(i)``: the field ``{label}.{field}`` and a message that starts ``{label}: ``."""
    built = []
    for i, item in enumerate(items):
        try:
            built.append(build(item))
        except InvalidRequest as exc:
            where = label(i)
            field = f"{where}.{exc.field}" if exc.field else where
            raise type(exc)(f"{where}: {exc.message}", field, exc.limit) from exc
    return built


def checked_request_id(request_id: Any, field: str = "request_id") -> str:
    """``request_id`` when it is a non-empty string (an ID read back, not checked against the submit rule:
    other clients' IDs are read too).

    Raises:
        InvalidRequest: naming ``field``.
    """
    if not isinstance(request_id, str) or not request_id:
        what = "empty" if request_id == "" else _shown(request_id)
        raise InvalidRequest(f"{field} must be a request ID (a non-empty string), not {what}", field, None)
    return request_id


def checked_request_ids(request_ids: Any) -> list[str]:
    """``request_ids`` read once into a list, each a request ID (see :func:`checked_request_id`).

    Raises:
        InvalidRequest: ``request_ids`` is a string or not iterable (named ``request_ids``), or an ID is bad
            (``request_ids[i]``).
    """
    if isinstance(request_ids, str | bytes) or not isinstance(request_ids, Iterable):
        raise InvalidRequest(f"request_ids must be an iterable of request IDs, not {type(request_ids).__name__}",
                             "request_ids", None)  # fmt: skip
    return [checked_request_id(rid, f"request_ids[{i}]") for i, rid in enumerate(request_ids)]


def seconds_limit(value: Any, field: str, *, positive: bool = False) -> float | None:
    """A time limit in seconds as a float, None for no limit (``None`` or ``inf``).

    Raises:
        InvalidRequest: naming ``field``: not a number (a bool neither), NaN, negative, or 0 when ``positive``.
    """
    if value is None:
        return None
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequest(f"{field} must be a number of seconds {bound}, or None for no limit; not "
                             f"{type(value).__name__} {value!r}"[:160], field, 0)  # fmt: skip
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0 or (positive and seconds == 0):
        raise InvalidRequest(f"{field} = {value!r} must be {bound} s (None or inf: no limit)", field, 0)
    return None if math.isinf(seconds) else seconds


def poll_interval_s(value: Any) -> float:
    """A poll interval (s): a finite number > 0.

    Raises:
        InvalidRequest: naming ``poll_s``.
    """
    # not seconds_limit: its message offers None and inf ("no limit"), which a poll interval cannot be
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise InvalidRequest(f"poll_s must be a finite number of seconds > 0, not {_shown(value)}", "poll_s", 0)
    return float(value)
