"""The same-weights page as Markdown: :func:`same_weights_body` (also the ``## Same weights`` section of
``docs/benchmarks.md``) and :func:`render_same_weights` (``same-weights.md``), from the results of
:func:`bench.same_weights.measure_same_weights`. Pure: no measuring, no files.
"""

from __future__ import annotations

from typing import Any

from bench.same_weights_plan import TEXT_ONLY

__all__ = ["render_same_weights", "same_weights_body"]


def _target_cell(value: float, target: float | None, *, at_least: bool) -> str:
    """``≥ 1.00×: met`` (or ``≤``, for a ratio that must stay under its target); ``–`` without one."""
    if target is None:
        return "–"
    met = value >= target if at_least else value <= target
    return f"{'≥' if at_least else '≤'} {target:.2f}×: {'met' if met else '**not met**'}"


def _fmt_spread(s: dict[str, float], unit: str = "") -> str:
    return f"{s['median']:.2f}{unit} ({s['min']:.2f}–{s['max']:.2f})"


def same_weights_body(results: dict[str, Any], level: str = "##") -> list[str]:
    """The intro sentence, per size (a ``level`` heading) its rows and ratios, and the method."""
    plan = results["plan"]
    lines = [
        "Each model is one random Llama (`tools/build_llama.py`) "
        f"exported two ways: the fleet's own export, served by the fleet, by the worker's own generation loop in "
        f"process and by a bare numpy + ONNX Runtime loop (`bench/bare_loop.py`), and onnxruntime-genai's model "
        f"builder (FP32, CPU) on the same weights, served "
        f"by `og.Engine` ({', '.join(results['genai_tier'][-2:])}). {plan['requests']} requests arriving together, "
        f"prompts {plan['prompt_tokens'][0]}–{plan['prompt_tokens'][1]} tokens, "
        f"{plan['new_tokens'][0]}–{plan['new_tokens'][1]} new tokens each (greedy, forced lengths), at most "
        f"{plan['max_batch_size']} running; {plan['rounds']} interleaved rounds after a warm one.",
        "",
    ]  # fmt: skip
    for s in results["sizes"]:
        size = s["size"]
        lines += [
            f"{level} {size['name']}: {s['parameters'] / 1e6:.1f} M weights",
            "",
            f"{size['num_layers']} layers, hidden {size['hidden_size']}, {size['num_heads']} query heads and "
            f"{size['num_kv_heads']} KV heads, vocabulary {size['vocab_size']}; {s['workload']['prompt_tokens']} "
            f"prompt tokens and {s['workload']['new_tokens']} new tokens per round.",
            "",
            "| row | tokens/s, median (range) | TTFT p50 ms | TTFT p99 ms | requests with tokens unlike the fleet's "
            "| requests with another token count |",
            "|---|---|---|---|---|---|",
        ]  # fmt: skip
        for name, row in s["rows"].items():
            t = row["tokens_per_s"]
            differ = "not compared (text)" if row["mismatched_requests"] is None else row["mismatched_requests"]
            ttft = ("–", "–") if name in TEXT_ONLY else (f"{row['ttft_ms']['p50']:.0f}", f"{row['ttft_ms']['p99']:.0f}")
            lines.append(f"| {name} | {t['median']:.0f} ({t['min']:.0f}–{t['max']:.0f}) | {ttft[0]} | {ttft[1]} "
                         f"| {differ} | {row['miscounted_requests']} |")  # fmt: skip
        targets = dict(size.get("targets", ()))
        lines += ["", "| ratio | median (range of the per-round ratios) | target |", "|---|---|---|"]
        for other, spread in s["ratios"].items():
            target = _target_cell(spread["median"], targets.get(other), at_least=True)
            label = other if " / " in other else f"fleet / {other}"
            lines.append(f"| {label} | {_fmt_spread(spread, '×')} | {target} |")
        target = _target_cell(s["ttft_p99_ratio"], targets.get("TTFT p99"), at_least=False)
        lines.append(f"| TTFT p99: fleet / bare continuous | {s['ttft_p99_ratio']:.2f}× | {target} |")
        per_round = "; ".join(f"{name}: {', '.join(f'{x:.0f}' for x in xs)}" for name, xs in s["per_round"].items())
        lines += ["", f"Tokens/s per round: {per_round}.", ""]
    lines += [
        "How it is measured: `bench/same_weights.py`. The fleet's span is first submit → last result read by "
        "the client; its TTFT is the worker's own figure (submit → first token). The loops' and og.Engine's "
        "times start when the run starts (every request is waiting then). The SDK's stream carries text, and a "
        "token without text (most ids of a vocabulary beyond the 256 bytes) sends no chunk: its TTFT is not "
        "given and its tokens are counted from `usage`, not compared. og.Engine runs in the `genai` "
        "tier's venv (`tools/tier_venvs.py`), one process per round (loading the model is not timed). The "
        "bare loop uses ONNX Runtime's default session options on the fleet's export as is; the worker "
        "rewrites that graph at load (LM head at the last position, KV cache written in place) and runs ONNX "
        "Runtime with its session options (intra-op spin-waiting bounded to `spin_duration_us` after each run): "
        "the worker's loop in process runs exactly that, without Celery, Redis or a stream, so the fleet's gap "
        "to it is what the queue and the transport cost.",
        "",
    ]  # fmt: skip
    return lines


def render_same_weights(results: dict[str, Any]) -> str:
    """``same-weights.md``: the stamp, then :func:`same_weights_body`."""
    meta = results["meta"]
    dirty = " (uncommitted changes)" if meta["dirty"] else ""
    body = same_weights_body(results)
    stamp = (f"From one `{meta['command']}` run at commit `{meta['commit']}`{dirty}, {meta['machine']}, "
             f"{meta['duration_s']:.0f} s.")  # fmt: skip
    return "\n".join(["# Same weights: the fleet, a bare loop and onnxruntime-genai", "", f"{stamp} {body[0]}",
                      *body[1:]])  # fmt: skip
