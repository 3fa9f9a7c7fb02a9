"""``fleet submit`` options for generation (``--generate``, ``--stream``, sampling) and the streaming printer."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from protocol.errors import InvalidRequest

__all__ = ["add_generation_args", "generation_from_args", "parse_ids", "print_stream"]

_FLAGS = ("max_new_tokens", "temperature", "top_p", "sample_top_k", "repetition_penalty", "seed", "stop",
          "stop_token_ids", "ignore_eos")


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """Register the generation options on ``fleet submit``."""
    g = p.add_argument_group(
        "generation (causal LMs; any of these makes the request a 'generate' job; an option left out takes "
        "the model's generation_config.json default, else the fleet's default shown below)"
    )
    g.add_argument("--generate", action="store_true", help="generate text instead of next-token top-k")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated (implies --generate)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="most tokens to generate (default 16)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default); else sampling temperature")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1 = off)")
    g.add_argument("--sample-top-k", type=int, default=None, help="sample among the k most likely (default 0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="1 = off (default)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same tokens")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", default=None, help="comma-separated ids that end the generation")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past the model's EOS")


def generation_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``generation`` fields the options ask for, or None for a one-step request."""
    given = {name: getattr(args, name) for name in _FLAGS if getattr(args, name) is not None}
    if not (given or args.generate or args.stream):
        return None
    if "sample_top_k" in given:
        given["top_k"] = given.pop("sample_top_k")
    if "stop_token_ids" in given:
        given["stop_token_ids"] = parse_ids(str(given["stop_token_ids"]), "--stop-token-ids", "stop_token_ids")
    return given


def parse_ids(raw: str, flag: str, field: str) -> list[int]:
    """The token ids of ``flag``, separated by commas and/or whitespace (``5,6,7``, ``5, 6, 7``, ``5 6 7``).

    Whitespace separates ids: it is never dropped inside one (``"5 6 7"`` once became the single id 567). An id
    is ASCII digits with an optional ``-``, as written, nothing dropped or read otherwise: an empty item
    (``5,,6``, ``5,6,``: a lost id) was skipped, ``5_0`` read as 50 and fullwidth ``５`` as 5. A blank ``raw``
    is no ids.

    Raises:
        InvalidRequest: an item is empty or not an integer; names ``flag``, the item and its position (1 = the
            first; exit 2, nothing queued).
    """
    if not raw.strip():
        return []
    items = [item for part in raw.split(",") for item in (part.split() or [""])]
    for position, item in enumerate(items, 1):
        if not _TOKEN_ID.fullmatch(item):
            said = "is empty" if item == "" else f"is {item!r}"
            raise InvalidRequest(f"{flag} must be comma-separated integers (or separated by spaces: 5,6,7 or "
                                 f"5 6 7): item {position} {said}", field, "integers")
    return [int(item) for item in items]


_TOKEN_ID = re.compile(r"-?[0-9]+")
"""One id of :func:`parse_ids`: ASCII digits (``str.isdigit`` and ``int`` take other scripts' digits too)."""


def print_stream(client: Any, request_id: str, timeout_s: float) -> int:
    """Print a generation's text as it arrives; a JSON summary goes to stderr. Returns the exit code."""
    for event in client.stream(request_id, timeout_s=timeout_s):
        if event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        if event.type == "error":
            print(file=sys.stdout)
            print(json.dumps({"request_id": request_id, "error": event.error, "message": event.message,
                              "field": event.field, "limit": event.limit}), file=sys.stderr)
            return 1
        if event.type == "final":
            print(file=sys.stdout)
            usage = event.usage.model_dump() if event.usage else None
            print(json.dumps({"request_id": request_id, "finish_reason": event.finish_reason, "usage": usage}),
                  file=sys.stderr)
    return 0
