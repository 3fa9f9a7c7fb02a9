"""``fleet status``'s text: the workers table and the per-model lines, from :func:`producer.ops_cli.status_document`'s
document (pure: no I/O)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_status"]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return lines


def _nodes(counts: dict[str, int] | None) -> str:
    """A heartbeat's ``nodes`` (graph nodes per execution provider) as ``CUDA 190, CPU 6``; ``-`` if not counted."""
    if not counts:
        return "-"
    return ", ".join(f"{name.removesuffix('ExecutionProvider')} {n}" for name, n in counts.items())


def _kv(doc: dict[str, Any] | None) -> str:
    """A heartbeat's ``kv_cache`` as ``in place float16 device 192 MiB`` (``+ cuda graphs`` when its decode steps
    replay CUDA graphs) or ``concat float32``; ``-`` without one."""
    if not doc:
        return "-"
    words = ["in place" if doc.get("cache") == "in_place" else str(doc.get("cache")), str(doc.get("dtype"))]
    if doc.get("memory"):
        words += [str(doc["memory"]), f"{int(doc.get('bytes') or 0) / 2**20:.0f} MiB"]
    if doc.get("cuda_graphs"):
        words.append("+ cuda graphs")
    return " ".join(words)


def format_status(doc: dict[str, Any]) -> str:
    """The human table of ``fleet status`` from its JSON document (see :func:`status_document`)."""
    workers = [
        [
            str(w.get("hostname")),
            str(w.get("model")),
            str(w.get("version")) + (f" +canary {w['canary_version']}" if w.get("canary_version") else ""),
            "yes" if w.get("ready") else "no",
            f"{w.get('in_flight', 0)}/{w.get('concurrency', '?')}",
            str(w.get("batches_run", 0)),
            ",".join(p.removesuffix("ExecutionProvider") for p in w.get("providers") or []),
            _nodes(w.get("nodes")),
            _kv(w.get("kv_cache")),
            _age(w.get("heartbeat_age_s")),
        ]
        for w in doc["workers"]
    ]
    queues = [
        [
            q["model"],
            q["queue"],
            str(q["depth"]),
            str(q["max_queue_depth"]),
            str(q["in_flight"]),
            f"{q['ready_workers']}/{q['workers']}",
            _age(q["oldest_waiting_s"]),
            f"{q['drain_rate_per_s']:.2f}",
        ]
        for q in doc["queues"]
    ]
    lines = ["WORKERS"]
    lines += _table(
        ["HOSTNAME", "MODEL", "VERSION", "READY", "IN-FLIGHT/C", "BATCHES", "PROVIDERS", "NODES", "KV CACHE",
         "HEARTBEAT"],
        workers,
    )
    if not workers:
        lines.append("(no live worker)")
    lines += ["", "QUEUES"]
    lines += _table(["MODEL", "QUEUE", "DEPTH", "CAP", "IN-FLIGHT", "READY", "OLDEST WAITING", "DRAIN REQ/S"], queues)
    lines += [f"{q['model']}: {q['direct_depth']} more waiting in workers' own queues ({q['queue']}.w.<hostname>)"
              for q in doc["queues"] if q.get("direct_depth")]  # fmt: skip
    if doc.get("models"):
        from producer.model_status import format_model_states

        lines += ["", *format_model_states(doc["models"])]
    if doc["problems"]:
        lines += ["", "NOT READY: " + "; ".join(doc["problems"])]
    return "\n".join(lines)
