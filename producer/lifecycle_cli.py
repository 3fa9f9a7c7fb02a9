"""``fleet models pin|canary|promote|rollback|history|compare``: a model's desired state in Redis.

Registered by :mod:`producer.models_cli` under ``fleet models``. Every change is one transaction
recorded in the model's history (:mod:`protocol.model_state`); workers follow it. Output is one JSON
document on stdout. ``pin`` and ``canary`` then wait up to ``--wait-s`` (10 s) for the live workers to
serve the version or refuse it, and add what they serve: ``served`` (stable version -> hosts),
``canary_served`` (loaded canary version -> hosts) and ``not_served`` (a sentence, also on stderr as
``fleet: NOT SERVED: …``). Exit codes follow ``fleet``'s: 0 ok; 1 refused (no canary to promote or roll
back, a rollback to a version the store no longer publishes; the message says why), or
``pin``/``canary`` waited (``--wait-s`` > 0) and no live worker serves the version in that role (each
refused it, e.g. a checksum mismatch, or did not switch in time: the change took effect nowhere; it
stays recorded: undo it with ``rollback``); 2 bad arguments or settings (unknown model, a version the
store does not publish, a weight outside 1..99, a version whose card does not fit the model: IncompatibleVersion, see
:mod:`protocol.version_fit`; checked by pin, canary and promote when a store is configured). A version
that some live workers serve and others do not (a worker without the store, a canary not loaded) exits 0
with the NOT SERVED line naming the others, as ``fleet status`` does. ``--wait-s 0`` waits for nothing
and judges nothing: exit 0 once recorded (``served`` / ``canary_served`` / ``not_served`` in the JSON
are one read of the heartbeats at that instant). With no live worker of the model, ``pin`` and
``canary`` exit 0 (a worker that starts reads the state). ``promote`` and ``rollback`` do not wait for
the workers: exit 0 once recorded (``fleet status`` says what is served). ``compare`` with a shadow sample
(``--shadow N`` or ``--prompts FILE``, a causal LM with a canary) sends nothing unless live workers serve the
stable and the canary version (else exit 1 at once, ``fleet: NOT SERVED: …`` naming what is missing and how to
start it), waits up to ``--shadow-timeout-s`` (120 s) with a progress bar on stderr, cancels what is unfinished
then (and says so), and exits 1 when every pair failed or timed out (answered, but by no stable/canary pair:
a fleet mixing other versions, said on stderr, exit 0); ``--prompts`` is read first, canary or not (a
file that cannot be read: exit 2).

With a store configured, ``pin`` and ``canary`` record the sha256 of the version's manifest
(``stable_manifest_sha256`` / ``canary_manifest_sha256`` in ``state`` and in each history entry's ``from``
and ``to``; ``fleet status`` shows its first 12 hex digits as ``VERSION @0123456789ab``): workers serve those
bytes or refuse the version ("manifest of … changed since it was pinned"); pinning it again accepts new bytes.

::

    fleet models pin M V                     # V serves all of M's traffic (the canary, if any, stays); waits
                                             # up to --wait-s 10 s for the workers; exit 1 if none serves V
    fleet models canary M V --weight 10      # 10 % of M's traffic to V, sticky by routing key; waits up to
                                             # --wait-s 10 s for the workers; exit 1 if none loaded V
    fleet models promote M                   # the canary becomes stable
    fleet models rollback M [--reason TEXT]  # drop the canary (with none: undo the last pin or promote)
    fleet models history M [--last N]        # who changed what, when, why
    fleet models compare M [--window-s S] [--shadow N | --prompts FILE] [--shadow-timeout-s 120]
                                             # per-version figures; p99_ms null below 100 requests, "tail":
                                             # "p95 (n=40)" names what they support; exit 1 if every shadow
                                             # pair failed or timed out
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
from pathlib import Path
from typing import Any, Literal

import redis

from producer.cli_types import number_in, setting_type, version_name, wait_seconds
from producer.shadow_verdict import SHADOW_TIMEOUT_S, shadow_exit_code, shadow_problem
from protocol.canary_verdict import version_figures
from protocol.errors import ConfigError
from protocol.model_state import (
    HistoryEntry,
    Published,
    VersionCheck,
    history,
    pin,
    promote,
    read_outcomes,
    read_state,
    recent_prompts,
    refusals,
    rollback,
    set_canary,
)
from protocol.redis_conn import sync_client
from protocol.settings import CanarySettings, FleetSettings, load_settings

__all__ = ["canary_exit_code", "default_by", "pin_exit_code", "register", "served_exit_code"]

Role = Literal["stable", "canary"]

DEFAULT_WAIT_S = 10.0
"""How long ``pin`` and ``canary`` wait for the live workers by default (``--wait-s``, s)."""


def default_by() -> str:
    """``$USER@hostname``: who a change is recorded as, unless ``--by`` says otherwise."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _print(doc: Any) -> None:
    print(json.dumps(doc))


def _context(args: argparse.Namespace) -> tuple[FleetSettings, redis.Redis[bytes], str]:
    settings = load_settings(args.config)
    return settings, sync_client(settings), settings.model_key(args.model)


def _published(
    settings: FleetSettings, model: str, version: str | None = None
) -> tuple[Published | None, VersionCheck | None]:
    """The store pins are checked against and the check that the version's card fits the model's
    (both None when no store is configured).

    Raises:
        ConfigError: no store is configured and ``version`` is not the model's configured file's version,
            which is the only one a worker without a store can load (it would refuse it: NOT SERVED).
    """
    if settings.store.backend == "none":
        from store.resolve import configured_file_version  # the label a store-less worker serves the file under

        configured = configured_file_version(settings, model)
        if version is not None and configured is not None and version != configured:
            raise ConfigError(
                f"{model} {version}: no model store is configured (store.backend: none), so a worker can serve only "
                f"the configured version {configured}; configure a store (FLEET_STORE__BACKEND, see README "
                f"'Model versions (store)') and publish {version} with `fleet models push`", "store.backend",
                "a model store")
        return None, None
    from store.cards import version_check
    from store.model_store import open_store

    store = open_store(settings.store)
    return store, version_check(settings, store)


def _change_doc(r: redis.Redis[bytes], model: str, entry: HistoryEntry) -> dict[str, Any]:
    state = read_state(r, model)
    return {"model": model, "change": entry.model_dump(mode="json", by_alias=True),
            "state": state.model_dump(mode="json") if state else None}


def _with_served(settings: FleetSettings, r: redis.Redis[bytes], model: str, doc: dict[str, Any],
                 wait_s: float) -> dict[str, Any]:
    """``doc`` plus what the workers serve once they applied the change (``--wait-s``); when it waited, a
    desired version that live workers do not serve is also said on stderr."""
    import sys

    from producer.model_status import await_served

    out = {**doc, **await_served(settings, r, model, wait_s)}
    if out["not_served"] and wait_s > 0:
        yet = "" if out["served"] else " yet: a worker that starts serves the desired state"
        print(f"fleet: {'NOT SERVED: ' if out['served'] else ''}{out['not_served']}{yet}", file=sys.stderr)
    return out


def served_exit_code(doc: dict[str, Any], version: str, wait_s: float, role: Role) -> int:
    """The exit code of a change that asks the live workers to serve ``version`` as ``role``, from its
    document (pure): 1 when it waited (``wait_s`` > 0) and live workers of the model run (``served`` is not
    empty: each serves some stable version), none of them serving ``version`` in that role (``served`` for
    stable, ``canary_served`` for canary): the change took effect nowhere. Else 0 (not waited for, served
    by some or all, or no live worker yet)."""
    live = doc.get("served") or {}
    serving = live if role == "stable" else doc.get("canary_served") or {}
    return 1 if wait_s > 0 and live and version not in serving else 0


def pin_exit_code(doc: dict[str, Any], version: str, wait_s: float) -> int:
    """``fleet models pin VERSION``'s exit code (pure): :func:`served_exit_code` for the stable role."""
    return served_exit_code(doc, version, wait_s, "stable")


def canary_exit_code(doc: dict[str, Any], version: str, wait_s: float) -> int:
    """``fleet models canary VERSION``'s exit code (pure): :func:`served_exit_code` for the canary role."""
    return served_exit_code(doc, version, wait_s, "canary")


def _recorded_and_served(settings: FleetSettings, r: redis.Redis[bytes], model: str, entry: HistoryEntry,
                         args: argparse.Namespace, role: Role) -> int:
    """Print the change ``entry`` with what the workers serve once they applied it (``--wait-s``); returns
    the exit code (:func:`served_exit_code` for ``args.version`` as ``role``)."""
    doc = _with_served(settings, r, model, _change_doc(r, model, entry), args.wait_s)
    _print(doc)
    return served_exit_code(doc, args.version, args.wait_s, role)


def cmd_pin(args: argparse.Namespace) -> int:
    settings, r, model = _context(args)
    store, check = _published(settings, model, args.version)
    entry = pin(r, model, args.version, args.by, store=store, check=check)
    return _recorded_and_served(settings, r, model, entry, args, "stable")


def cmd_canary(args: argparse.Namespace) -> int:
    settings, r, model = _context(args)
    store, check = _published(settings, model, args.version)
    entry = set_canary(r, model, args.version, args.weight, args.by, store=store, check=check)
    return _recorded_and_served(settings, r, model, entry, args, "canary")


def cmd_promote(args: argparse.Namespace) -> int:
    settings, r, model = _context(args)
    _, check = _published(settings, model)
    _print(_change_doc(r, model, promote(r, model, args.by, check=check)))
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    settings, r, model = _context(args)
    store, _ = _published(settings, model)  # undoing a pin or promote returns only to a version still published
    _print(_change_doc(r, model, rollback(r, model, args.by, reason=args.reason, store=store)))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    _, r, model = _context(args)
    state = read_state(r, model)
    _print({"model": model, "state": state.model_dump(mode="json") if state else None,
            "history": [e.model_dump(mode="json", by_alias=True) for e in history(r, model, last=args.last)],
            "refusals": [x.model_dump(mode="json") for x in refusals(r, model, last=args.last)]})
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    prompts = _prompts_file(args)  # bad input first, whether or not a canary is set
    settings, r, model = _context(args)
    state = read_state(r, model)
    window_s = args.window_s if args.window_s is not None else settings.model(model).canary.window_s
    samples = read_outcomes(r, model, window_s)
    figures = version_figures(samples)
    roles = {v: sorted({s.role for s in samples if s.version == v}) for v in figures}
    doc: dict[str, Any] = {
        "model": model,
        "window_s": window_s,
        "state": state.model_dump(mode="json") if state else None,
        "versions": [{**f.to_dict(), "roles": roles[v]} for v, f in figures.items()],
        "shadow": None,
    }
    asked = bool(args.shadow or prompts is not None)
    if state is not None and state.canary is not None and asked:
        doc["shadow"] = _shadow(settings, model, state, args, prompts)
    _print(doc)
    if asked and doc["shadow"] is None:  # said, not left as a bare null: there is nothing to shadow
        print(f"fleet: note: no shadow sample sent: model {model!r} has no canary (`fleet models canary {model} "
              "VERSION --weight W` sets one)", file=sys.stderr)
    problem = shadow_problem(doc["shadow"])
    if problem is not None:
        print(f"fleet: {problem}", file=sys.stderr)
    return shadow_exit_code(doc["shadow"])


def _prompts_file(args: argparse.Namespace) -> list[str | list[int]] | None:
    """The prompts of ``--prompts FILE`` (None without it).

    Raises:
        InvalidRequest: the file is missing, unreadable or not a JSON list of prompts (names ``--prompts``).
    """
    from producer.shadow import load_prompts

    return load_prompts(Path(args.prompts)) if args.prompts is not None else None


def _shadow(settings: FleetSettings, model: str, state: Any, args: argparse.Namespace,
            prompts_file: list[str | list[int]] | None) -> dict[str, Any] | None:
    from producer.client import FleetClient
    from producer.shadow import shadow_agreement, synthetic_prompts

    client = FleetClient(settings)
    try:
        _, info = client._model(model)
        if info.card is not None and info.card.kind != "causal_lm":
            return None  # agreement of next tokens means something for LMs only
        prompts: list[str | list[int]]
        if prompts_file is not None:
            prompts, recent = prompts_file, 0
        elif info.card is None:  # no card here nor published by a worker: no live worker (said as not served)
            prompts, recent = [], 0
        else:  # the recent prompts producers sampled, topped up with generated ones
            prompts = list(recent_prompts(client.redis, model, args.shadow))
            recent = len(prompts)
            limit = settings.model(model).limits.max_input_tokens
            prompts += synthetic_prompts(args.shadow - recent, info.card.vocab_size, limit)
        doc = shadow_agreement(client, model, state, prompts, timeout_s=args.shadow_timeout_s)
        return {**doc, "recent_prompts": recent}
    finally:
        client.close()


_weight = number_in(int, 1, 99, "weight must be an integer from 1 to 99 (percent of traffic)")
_shadow_count = number_in(int, 0, 10_000, "shadow must be an integer from 0 to 10000 prompts")
_shadow_timeout_s = number_in(float, 0, 86_400, "shadow-timeout-s must be a number of seconds from 0 to 86400")


def register(msub: Any) -> None:
    """Add the lifecycle commands to ``fleet models``' sub-parsers."""
    from producer.cli import _add_common

    def common(p: argparse.ArgumentParser, *, by: bool = True) -> None:
        _add_common(p)
        p.add_argument("model", help="a configured model, e.g. demo-lm")
        if by:
            p.add_argument("--by", default=default_by(), help="who the change is recorded as (default $USER@host)")

    def wait_s(p: argparse.ArgumentParser, serve: str) -> None:
        p.add_argument("--wait-s", type=wait_seconds, default=DEFAULT_WAIT_S,
                       help=f"wait up to this many seconds for the live workers to {serve} or refuse it, then print "
                       "what they serve (\"served\", \"canary_served\", \"not_served\"); exit 1 when none of them "
                       f"does; 0 = do not wait nor judge (exit 0 once recorded) (default {DEFAULT_WAIT_S:g})")

    p = msub.add_parser("pin", help="serve VERSION for all of the model's (stable) traffic")
    common(p)
    p.add_argument("version", type=version_name,
                   help="a version published in the store (or the configured one), e.g. 1.2.3")
    wait_s(p, "serve VERSION")
    p.set_defaults(func=cmd_pin)

    p = msub.add_parser("canary", help="send --weight percent of the model's traffic to VERSION")
    common(p)
    p.add_argument("version", type=version_name, help="a version published in the store, e.g. 1.2.4-int8")
    p.add_argument("--weight", type=_weight, required=True, help="percent of traffic to the canary, 1..99")
    wait_s(p, "load VERSION as the canary")
    p.set_defaults(func=cmd_canary)

    p = msub.add_parser("promote", help="make the canary the stable version")
    common(p)
    p.set_defaults(func=cmd_promote)

    p = msub.add_parser("rollback", help="drop the canary (with none: undo the last pin or promote)")
    common(p)
    p.add_argument("--reason", default=None, help="why, recorded in the history")
    p.set_defaults(func=cmd_rollback)

    p = msub.add_parser("history", help="the model's state, its changes and the workers' refusals")
    common(p, by=False)
    p.add_argument("--last", type=int, default=None, help="only the last N entries (default: all)")
    p.set_defaults(func=cmd_history)

    p = msub.add_parser("compare", help="per-version requests, error rate, p50, p99 (from 100 requests; below: the "
                        "highest percentile they support, named) (and LM agreement)")
    common(p, by=False)
    p.add_argument("--window-s", type=setting_type(CanarySettings, "models.<m>.canary.window_s"), default=None,
                   help="outcomes of the last S seconds (default: models.<m>.canary.window_s)")
    p.add_argument("--shadow", type=_shadow_count, default=0,
                   help="LMs with a canary: send N recent prompts (topped up with generated ones) to both versions "
                   "and report top-1 agreement (default 0 = no shadow)")
    p.add_argument("--prompts", default=None, help="LMs: a JSON list of texts or id lists to use as the shadow sample "
                   "(checked with or without a canary: a file that cannot be read exits 2)")
    p.add_argument("--shadow-timeout-s", type=_shadow_timeout_s, default=SHADOW_TIMEOUT_S,
                   help="wait up to this many seconds for the shadow sample's results, then cancel those unfinished "
                   f"(default {SHADOW_TIMEOUT_S:g}); nothing is sent unless live workers serve the stable and the "
                   "canary version (exit 1, NOT SERVED); exit 1 too when no pair could be compared")
    p.set_defaults(func=cmd_compare)

