"""Shadow comparison of a causal LM's canary with its stable version (``fleet models compare``).

Each prompt is sent twice, explicitly to each role's queue (:meth:`FleetClient.send` with
``role=``), as a ``next_token`` request; a pair counts only when its results name the stable and the
canary version (a worker that has not loaded the canary yet computes canary-queue requests with the
stable version). Agreement = the fraction of counted pairs whose greedy top-1 token ids are equal.

Nothing is sent unless live workers serve both versions (:func:`producer.shadow_verdict.shadow_not_served`):
the sample would wait for nobody. The wait shows a progress bar on stderr (a terminal only); requests still
unfinished when it ends (its deadline, Ctrl-C, a failure) are cancelled, so none runs later for nobody.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from producer.client import FleetClient
from producer.shadow_verdict import SHADOW_TIMEOUT_S, shadow_not_served
from protocol.errors import FleetError, InvalidRequest, ResultTimeout
from protocol.messages import InferenceRequest, InferenceResult
from protocol.model_state import ModelState, Role

__all__ = ["SHADOW_TIMEOUT_S", "load_prompts", "shadow_agreement", "synthetic_prompts"]

ROLES: tuple[Role, Role] = ("stable", "canary")

PROGRESS_STEP_S = 0.5
"""How often the wait counts the finished requests for its progress bar (s)."""

Outcome = InferenceResult | FleetError


def synthetic_prompts(n: int, vocab_size: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` reproducible prompts of 4..min(32, max_tokens) ids drawn from [0, vocab_size)."""
    rng = random.Random(seed)
    longest = max(1, min(32, max_tokens))
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(min(4, longest), longest))] for _ in range(n)]


def load_prompts(path: Path) -> list[str | list[int]]:
    """Prompts from a JSON file: a list of texts and/or token-id lists.

    Raises:
        InvalidRequest: the file is not such a list (names the file).
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"--prompts {path}: cannot read a JSON list: {exc}", "prompts", "JSON list") from exc
    ok = isinstance(doc, list) and doc and all(
        isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p)) for p in doc
    )
    if not ok:
        raise InvalidRequest(f"--prompts {path}: must be a non-empty JSON list of texts or token-id lists",
                             "prompts", "list of str | list[int]")
    return list(doc)


def _top1(result: InferenceResult) -> int | None:
    return result.top_k[0].token_id if result.top_k else None


def _next_token_request(client: FleetClient, model: str, prompt: str | list[int], n: int) -> InferenceRequest:
    """Prompt ``n`` of the file as a greedy top-1 request; an error names the prompt (``prompts[n]``)."""
    try:
        if isinstance(prompt, str):
            return client.build_request(model, text=prompt, top_k=1, kind="next_token")
        return client.build_request(model, prompt, top_k=1, kind="next_token")
    except InvalidRequest as exc:
        where = f"prompts[{n}]" + (f".{exc.field}" if exc.field else "")
        raise type(exc)(f"--prompts item {n}: {exc.message}", where, exc.limit) from exc


def _not_served(client: FleetClient, model: str, state: ModelState) -> str | None:
    """:func:`shadow_not_served` from one read of the live workers' heartbeats."""
    from producer.model_status import await_served

    settings = client.settings
    served = await_served(settings, client.redis, model, 0)
    stable = state.stable or settings.models[model].store_version
    queues = (settings.queue_for(model), settings.canary_queue_for(model))
    return shadow_not_served(model, stable, str(state.canary), served["served"], served["canary_served"], queues)


def _wait(client: FleetClient, model: str, ids: Sequence[str], timeout_s: float, done: dict[str, Outcome]) -> None:
    """Fill ``done`` with the outcomes of ``ids`` as they finish, up to ``timeout_s`` (monotonic), advancing a
    progress bar on stderr (shown on a terminal only) every :data:`PROGRESS_STEP_S`."""
    from tqdm import tqdm

    deadline = time.monotonic() + timeout_s
    remaining = list(ids)
    with tqdm(total=len(ids), desc=f"shadow {model}", unit="req", disable=None, file=sys.stderr, leave=False) as bar:
        while remaining:
            left_s = deadline - time.monotonic()
            outcomes = client.wait(remaining, max(0.0, min(PROGRESS_STEP_S, left_s)))
            # ResultTimeout here is the step's own "not finished yet" (no worker stores one)
            finished = {rid: o for rid, o in zip(remaining, outcomes, strict=True) if type(o) is not ResultTimeout}
            done.update(finished)
            bar.update(len(finished))
            remaining = [rid for rid in remaining if rid not in finished]
            if left_s <= PROGRESS_STEP_S:
                break


def _cancel(client: FleetClient, ids: Sequence[str]) -> int:
    """Cancel each of ``ids`` (:meth:`FleetClient.cancel`); how many cancels took (False: it had finished)."""
    return sum(client.cancel(rid) for rid in ids)


def shadow_agreement(
    client: FleetClient,
    model: str,
    state: ModelState,
    prompts: Sequence[str | list[int]],
    *,
    timeout_s: float = SHADOW_TIMEOUT_S,
) -> dict[str, Any]:
    """Send every prompt to both role queues and report how often the top-1 ids agree.

    Every prompt is checked first, then whether live workers serve both versions: when not, nothing is sent
    and ``not_served`` says what is missing and how to start it. The results are waited for up to
    ``timeout_s`` (s); those still unfinished then are cancelled (``unfinished``, ``cancelled``), as they are
    when the wait is interrupted (the interrupt is raised again).

    Raises:
        InvalidRequest: a prompt cannot be sent (named ``prompts[n]``); nothing was sent.
    """
    pairs = [[_next_token_request(client, model, prompt, n) for _role in ROLES] for n, prompt in enumerate(prompts)]
    doc: dict[str, Any] = {"prompts": len(pairs), "compared": 0, "failed": 0, "unfinished": 0, "cancelled": 0,
                           "timeout_s": timeout_s, "agreement": None,
                           "measure": "greedy top-1 next-token id, stable vs canary",
                           "not_served": _not_served(client, model, state)}  # fmt: skip
    if doc["not_served"] is not None:
        return doc
    sent: list[str] = []  # stable, canary, stable, …: every prompt was checked first, a bad one leaves nothing sent
    results: dict[str, Outcome] = {}
    try:
        for pair in pairs:
            for request, role in zip(pair, ROLES, strict=True):
                sent.append(client.send(request, role=role))
        _wait(client, model, sent, timeout_s, results)
    except BaseException:
        with contextlib.suppress(Exception):  # best effort: what stopped the wait is what is reported
            _cancel(client, [rid for rid in sent if rid not in results])
        raise
    unfinished = [rid for rid in sent if rid not in results]
    doc["unfinished"], doc["cancelled"] = len(unfinished), _cancel(client, unfinished)
    agreed = 0
    for stable_id, canary_id in zip(sent[::2], sent[1::2], strict=True):
        a, b = results.get(stable_id), results.get(canary_id)
        if not isinstance(a, InferenceResult) or not isinstance(b, InferenceResult):
            doc["failed"] += 1
            continue
        if b.version != state.canary or a.version == state.canary or (state.stable and a.version != state.stable):
            continue  # not a stable/canary pair: the worker had not loaded the canary yet
        doc["compared"] += 1
        agreed += _top1(a) == _top1(b)
    doc["agreement"] = round(agreed / doc["compared"], 4) if doc["compared"] else None
    return doc
