"""Order evidence from Redis's own ``MONITOR`` that a token stream was read while its request still ran.

A reader's own clock cannot show it on a loaded machine: a starved client may parse its first chunk after the
worker finished. A stream reader is a generator its consumer pulls (the gateway's relay, the CLI's printer):
it asks for entries past the first ones only once it has handed those on, so such an ``XREAD`` before the
worker stores the final result shows the tokens were passed on while the request ran.
"""

from __future__ import annotations

from protocol.keys import STREAM_KEY

__all__ = ["asked_past_first", "relayed_before_stored"]


def asked_past_first(commands: list[str], rid: str) -> bool:
    """Whether a reader asked for the request's stream entries after one it had already received (an ``XREAD``
    naming the stream with a last ID past ``0-0``)."""
    stream = STREAM_KEY.format(id=rid)
    for command in commands:
        words = command.split(" ")
        if words[0] == "XREAD" and stream in words:
            keys = words[words.index("STREAMS") + 1 :]
            if keys[keys.index(stream) + len(keys) // 2] not in ("0", "0-0", "$"):
                return True
    return False


def relayed_before_stored(commands: list[str], rid: str) -> bool:
    """Whether, in Redis's own order of commands (``MONITOR``), a reader (the gateway's relay, the CLI) asked for
    the request's stream entries after one it had already received (:func:`asked_past_first`) before the worker
    stored the request's final result: tokens were passed on while it ran."""
    result = f"celery-task-meta-{rid}"
    stored = next(i for i, c in enumerate(commands) if result in c and '"status": "SUCCESS"' in c)
    return asked_past_first(commands[:stored], rid)
