"""What workers and producers report about a model's versions while they serve it: refusals to load a
version (the last 50, for 7 days), a 1-in-20 sample of recent prompts while a canary is set (the last 200,
for a day: ``fleet models compare``'s shadow sample) and the outcome of each finished request while a
canary is set (a stream, ~20,000 entries: what :mod:`protocol.canary_guard` judges).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import redis

from protocol.canary_verdict import Outcome
from protocol.model_records import OUTCOMES_KEY, RECENT_PROMPTS_KEY, REFUSALS_KEY, Refusal, Role
from protocol.model_routing import routing_fraction

__all__ = [
    "AT_PRECISION_S",
    "OUTCOMES_MAXLEN",
    "RECENT_PROMPTS_KEEP",
    "RECENT_PROMPTS_TTL_S",
    "RECENT_SAMPLE_FRACTION",
    "REFUSALS_KEEP",
    "REFUSALS_TTL_S",
    "outcome_fields",
    "read_outcomes",
    "recent_prompts",
    "record_outcomes",
    "record_recent_prompt",
    "record_refusal",
    "refusals",
    "samples_prompt",
]

REFUSALS_KEEP = 50
REFUSALS_TTL_S = 7 * 86_400
OUTCOMES_MAXLEN = 20_000
RECENT_PROMPTS_KEEP = 200
AT_PRECISION_S = 0.001
"""Outcomes carry ``at`` rounded to the millisecond: one finished just after a change may read as just before."""
RECENT_PROMPTS_TTL_S = 86_400
RECENT_SAMPLE_FRACTION = 0.05


# ---- refusals (written by workers) ----


def record_refusal(r: redis.Redis[bytes], model: str, worker: str, version: str, exc: BaseException) -> Refusal:
    """Record that ``worker`` refused ``version`` (kept: the last 50, for 7 days)."""
    refusal = Refusal(worker=worker, version=version, error=str(exc), error_type=type(exc).__name__,
                      at_unix_s=time.time())
    key = REFUSALS_KEY.format(model=model)
    pipe = r.pipeline(transaction=False)
    pipe.rpush(key, refusal.model_dump_json())
    pipe.ltrim(key, -REFUSALS_KEEP, -1)
    pipe.expire(key, REFUSALS_TTL_S)
    pipe.execute()
    return refusal


def refusals(r: redis.Redis[bytes], model: str, last: int | None = None) -> list[Refusal]:
    """The model's recorded refusals, oldest first (only the ``last`` N when given)."""
    start = -last if last else 0
    return [Refusal.model_validate_json(raw) for raw in r.lrange(REFUSALS_KEY.format(model=model), start, -1)]


# ---- recent prompts (sampled by producers while a canary is set: compare's shadow sample) ----


def samples_prompt(request_id: str) -> bool:
    """Whether the prompt of ``request_id`` is one of the sampled 1 in 20 (a hash apart from routing's)."""
    return routing_fraction("recent-prompt:" + request_id) < RECENT_SAMPLE_FRACTION


def record_recent_prompt(r: redis.Redis[bytes], model: str, input_ids: Iterable[int]) -> None:
    """Keep ``input_ids`` among the model's recent prompts (newest first, the last 200, for a day)."""
    key = RECENT_PROMPTS_KEY.format(model=model)
    pipe = r.pipeline(transaction=False)
    pipe.lpush(key, json.dumps(list(input_ids)))
    pipe.ltrim(key, 0, RECENT_PROMPTS_KEEP - 1)
    pipe.expire(key, RECENT_PROMPTS_TTL_S)
    pipe.execute()


def recent_prompts(r: redis.Redis[bytes], model: str, n: int) -> list[list[int]]:
    """Up to ``n`` of the model's most recent sampled prompts (token ids), newest first."""
    return [json.loads(raw) for raw in r.lrange(RECENT_PROMPTS_KEY.format(model=model), 0, n - 1)] if n > 0 else []


# ---- outcomes (written by workers while a canary is set) ----


def outcome_fields(version: str, role: Role, ok: bool, latency_ms: float, at_unix_s: float,
                   asked: Role | None = None) -> dict[str, str]:
    """The stream entry of one finished request (``asked``: its queue's role, None = ``role``)."""
    return {"version": version, "role": role, "ok": "1" if ok else "0", "latency_ms": f"{latency_ms:.3f}",
            "at": f"{at_unix_s:.3f}", "asked": asked or role}


def record_outcomes(pipe: Any, model: str, samples: Iterable[Outcome]) -> None:
    """Queue one XADD per sample on ``pipe`` (a redis pipeline: the caller executes it once per batch)."""
    key = OUTCOMES_KEY.format(model=model)
    for s in samples:
        fields = outcome_fields(s.version, s.role, s.ok, s.latency_ms, s.at_unix_s, s.asked)
        pipe.xadd(key, fields, maxlen=OUTCOMES_MAXLEN, approximate=True)


def read_outcomes(r: redis.Redis[bytes], model: str, window_s: float, *, since_unix_s: float = 0.0) -> list[Outcome]:
    """Outcomes that finished in the last ``window_s`` seconds (and not before ``since_unix_s``)."""
    floor = max(time.time() - window_s, since_unix_s)
    entries = r.xrange(OUTCOMES_KEY.format(model=model), min=str(max(0, int(floor * 1000) - 1_000)), max="+")
    out = []
    for _id, fields in entries:
        f = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
             for k, v in fields.items()}
        at = float(f["at"])
        if at >= floor - AT_PRECISION_S:
            role: Role = "canary" if f["role"] == "canary" else "stable"
            asked: Role = "canary" if f.get("asked", f["role"]) == "canary" else "stable"
            out.append(Outcome(f["version"], role, f["ok"] == "1", float(f["latency_ms"]), at, asked))
    return out

