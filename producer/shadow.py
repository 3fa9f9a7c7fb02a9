"""Shadow comparison of a causal LM's canary with its stable version (``fleet models compare``).

Each prompt is sent twice, explicitly to each role's queue (:meth:`FleetClient.send` with
``role=``), as a ``next_token`` request; a pair counts only when its results name the stable and the
canary version (a worker that has not loaded the canary yet computes canary-queue requests with the
stable version). Agreement = the fraction of counted pairs whose greedy top-1 token ids are equal.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from producer.client import FleetClient
from protocol.errors import InvalidRequest
from protocol.messages import InferenceRequest, InferenceResult
from protocol.model_state import ModelState, Role

__all__ = ["load_prompts", "shadow_agreement", "synthetic_prompts"]

ROLES: tuple[Role, Role] = ("stable", "canary")

SHADOW_TIMEOUT_S = 120.0
"""How long the shadow sample's results are waited for (s)."""


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


def shadow_agreement(
    client: FleetClient, model: str, state: ModelState, prompts: Sequence[str | list[int]]
) -> dict[str, Any]:
    """Send every prompt to both role queues and report how often the top-1 ids agree."""
    pairs = [[_next_token_request(client, model, prompt, n) for _role in ROLES] for n, prompt in enumerate(prompts)]
    sent: list[tuple[str, str]] = []  # every prompt was checked first: a bad one leaves nothing sent
    for pair in pairs:
        stable_id, canary_id = (client.send(request, role=role) for request, role in zip(pair, ROLES, strict=True))
        sent.append((stable_id, canary_id))
    flat = [rid for pair in sent for rid in pair]
    results = dict(zip(flat, client.wait(flat, SHADOW_TIMEOUT_S), strict=True))
    compared = agreed = failed = 0
    for stable_id, canary_id in sent:
        a, b = results[stable_id], results[canary_id]
        if not isinstance(a, InferenceResult) or not isinstance(b, InferenceResult):
            failed += 1
            continue
        if b.version != state.canary or a.version == state.canary or (state.stable and a.version != state.stable):
            continue  # not a stable/canary pair: the worker had not loaded the canary yet
        compared += 1
        agreed += _top1(a) == _top1(b)
    return {
        "prompts": len(sent),
        "compared": compared,
        "failed": failed,
        "agreement": round(agreed / compared, 4) if compared else None,
        "measure": "greedy top-1 next-token id, stable vs canary",
    }
