"""argparse types of the ``fleet`` CLI that refuse a value out of range when the command line is parsed:
exit 2 and one line ``argument --FLAG: …`` naming the range, before anything runs.

A flag that overrides a setting takes :func:`setting_type`: it accepts exactly what the setting accepts
(``fleet api --port 99999`` is refused as ``FLEET_API__PORT=99999`` is). A port with no setting behind it
(``fleet redis``, ``fleet store``) takes :data:`port_number`; other bounded numbers :func:`number_in`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, cast

from pydantic import BaseModel, TypeAdapter, ValidationError

__all__ = ["number_in", "port_number", "setting_type", "version_name", "wait_seconds"]

N = TypeVar("N", int, float)

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_KINDS: dict[object, str] = {int: "an integer", float: "a number"}


def setting_type(section: type[BaseModel], setting: str) -> Callable[[str], Any]:
    """An argparse ``type`` for a flag overriding ``setting`` (dotted, e.g. ``api.port``; its last part is
    the field of ``section``): the field's own type and limits, so flag and setting refuse the same values.

    The type raises ``argparse.ArgumentTypeError`` naming the setting, its variable and its range.
    """
    info = section.model_fields[setting.rsplit(".", 1)[-1]]
    adapter: TypeAdapter[Any] = TypeAdapter(cast(Any, Annotated[info.annotation, *info.metadata]))
    bounds = [f"{sign} {getattr(m, attr)}" for m in info.metadata for attr, sign in _BOUNDS if hasattr(m, attr)]
    env = "FLEET_" + "__".join(part.upper().replace("-", "_") for part in setting.split("."))
    rule = " ".join([_KINDS.get(info.annotation, "a valid value"), " and ".join(bounds)]).strip()

    def parse(raw: str) -> Any:
        try:
            return adapter.validate_python(raw)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(f"{setting} ({env}) must be {rule}, got {raw!r}") from exc

    parse.__name__ = setting  # what argparse names in any message of its own
    return parse


def number_in(kind: Callable[[str], N], low: float, high: float, rule: str) -> Callable[[str], N]:
    """An argparse ``type``: the value read as ``kind`` (int, float) from ``low`` to ``high`` (both included).

    The type raises ``argparse.ArgumentTypeError("<rule>, got '<value>'")`` for anything else (NaN too).
    """

    def parse(raw: str) -> N:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{rule}, got {raw!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{rule}, got {raw!r}")
        return value

    parse.__name__ = rule  # what argparse names in any message of its own
    return parse


port_number = number_in(int, 0, 65535, "must be an integer from 0 to 65535 (0 = a free one)")
"""A TCP port on 127.0.0.1 for a local server (``fleet redis``, ``fleet store``): 0 picks a free one."""


def version_name(raw: str) -> str:
    """An argparse ``type`` for a model version: one path segment of the store (``store.manifest.check_name``:
    1-128 of ``A-Z a-z 0-9 . _ + -``, starting with a letter or digit). An empty or blank version was refused
    only later, as a refused state change (exit 1), where ``../x`` was bad input (exit 2)."""
    from protocol.errors import InvalidRequest
    from store.manifest import check_name

    try:
        return check_name(raw, "version")
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(exc.message.removeprefix("version ")) from None


wait_seconds = number_in(float, 0, 3600, "must be a number of seconds from 0 to 3600")
"""``--wait-s`` of ``fleet models pin``/``canary``: how long to wait for the workers (NaN and negatives refused)."""
