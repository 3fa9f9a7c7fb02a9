"""CLI glue for ``fleet quantize`` (see :mod:`tools.quantize`); ``register(subparsers)`` adds it.

Prints the JSON report on stdout. Exit codes: 0 written; 1 refused by the accuracy gate (the
message on stderr gives the measured figures, nothing is written) or by the store (``--publish``:
the version exists, the store cannot be reached); 2 bad arguments or files, INT8 for ``--target cuda`` (no
INT8 kernels there: the line says why and what to do instead), or a ``--mode`` the target does not take.

``--target cpu`` (default) quantizes as ``--mode`` says (dynamic by default); ``--target tensorrt``
quantizes static QDQ, symmetric (``--mode static --symmetric``), what TensorRT builds INT8 layers from;
``--target cuda`` converts to FP16 (``--mode fp16``, :mod:`tools.fp16`), a causal LM or an encoder.

``--publish VERSION`` then pushes the written INT8 file, its card and its ``.report.json`` to the
model store (``store`` settings) as ``<name>/<VERSION>``, e.g. ``demo-lm/1.2.3-int8``; the JSON on
stdout gains ``published`` (the version's summary and manifest checksum).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producer.cli_types import number_in

if TYPE_CHECKING:
    from store.model_store import ModelStore

__all__ = ["op_type_list", "register", "run_quantize"]

_COUNT = number_in(int, 1, math.inf, "must be an integer >= 1 (prompts)")
_TOKENS = number_in(int, 1, math.inf, "must be an integer >= 1 (tokens)")
_SEED = number_in(int, 0, math.inf, "must be an integer >= 0")
_FRACTION = number_in(float, 0, 1, "must be a number from 0 to 1 (a fraction of the prompts)")
_NATS = number_in(float, 0, sys.float_info.max, "must be a finite number >= 0 (nats)")
_COSINE = number_in(float, -1, 1, "must be a number from -1 to 1 (a cosine similarity)")
_ROUNDS = number_in(int, 1, math.inf, "must be an integer >= 1 (timed runs)")
_THREADS = number_in(int, 0, math.inf, "must be an integer >= 0 (0 = all cores)")
"""argparse types of the numeric flags: each refuses NaN, and a value out of its range naming the range."""


def op_type_list(raw: str) -> tuple[str, ...]:
    """``--op-types``: comma-separated op types that ONNX Runtime's quantizer knows (dynamic or static).

    Raises:
        argparse.ArgumentTypeError: no op type, or one the quantizer does not know (named, with the known ones).
    """
    from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry, QLinearOpsRegistry

    known = sorted({*IntegerOpsRegistry, *QDQRegistry, *QLinearOpsRegistry})
    names = [t.strip() for t in raw.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError(f"must name at least one op type, e.g. MatMul,Gather; got {raw!r}")
    for position, name in enumerate(names, 1):
        if not name:
            raise argparse.ArgumentTypeError(f"item {position} is empty (write MatMul,Gather), got {raw!r}")
        if name not in known:
            raise argparse.ArgumentTypeError(f"item {position} {name!r} is not an op type ONNX Runtime quantizes "
                                             f"(one of {', '.join(known)})")
    return tuple(names)


op_type_list.__name__ = "--op-types"  # what argparse names in any message of its own


def register(subparsers: Any) -> None:
    """Add the ``quantize`` sub-command to an ``argparse`` sub-parsers object."""
    from tools.quantize_config import TARGETS, QuantizeConfig

    d = QuantizeConfig()
    p: argparse.ArgumentParser = subparsers.add_parser(
        "quantize",
        help="write an INT8 (dynamic or static QDQ) or FP16 copy of a model with an accuracy report and gate",
        description="Quantize MODEL.onnx to INT8 or FP16 next to it (e.g. demo-lm-1.0.0-int8.onnx + card + "
        ".report.json). The gate refuses to write a model below --min-top1-agreement or above --max-kl (an "
        "encoder, FP16 only: below --min-cosine).",
    )
    p.add_argument("model", type=Path, help="FP32 .onnx file with its model card (.json) next to it")
    p.add_argument(
        "--target",
        choices=TARGETS,
        default=d.target,
        help="where the model runs: cpu (--mode as given, dynamic INT8 by default), tensorrt (static QDQ "
        "symmetric), cuda (FP16; INT8 refused: the CUDA EP has no INT8 kernels)",
    )
    p.add_argument(
        "--mode",
        choices=["dynamic", "static", "fp16"],
        default=None,
        help="dynamic INT8 (no data), static QDQ INT8 with calibration, or fp16 (weights, activations and KV "
        f"cache in float16); default: the target's ({d.mode} for cpu, fp16 for cuda)",
    )
    p.add_argument(
        "--symmetric",
        action="store_true",
        help="static only: signed symmetric activations/weights, for TensorRT's INT8 path",
    )
    p.add_argument("--per-channel", action="store_true", help="per-channel weight scales")
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help='static: JSONL of token sequences (a list of ids, or {"input_ids": [...]}, per line); '
        f"default: {d.calibration_count} seeded synthetic prompts",
    )
    p.add_argument(
        "--calibration-count",
        type=_COUNT,
        default=d.calibration_count,
        help="synthetic calibration prompts when no --calibration file is given (default %(default)s)",
    )
    p.add_argument(
        "--op-types",
        type=op_type_list,
        default=None,
        help="comma-separated op types to quantize (default: ORT's for dynamic, MatMul,Gather for static)",
    )
    p.add_argument(
        "--eval",
        dest="eval_path",
        type=Path,
        default=None,
        help=f"held-out JSONL prompts for the report; default: {d.eval_count} seeded synthetic ones",
    )
    p.add_argument("--eval-count", type=_COUNT, default=d.eval_count,
                   help="synthetic held-out prompts when no --eval file is given (default %(default)s)")
    p.add_argument("--min-tokens", type=_TOKENS, default=d.min_tokens,
                   help="shortest synthetic prompt (tokens; default %(default)s)")
    p.add_argument("--max-tokens", type=_TOKENS, default=d.max_tokens,
                   help="longest synthetic prompt (tokens; default %(default)s)")
    p.add_argument("--seed", type=_SEED, default=d.seed, help="seed of the synthetic prompts (default %(default)s)")
    p.add_argument(
        "--min-top1-agreement",
        type=_FRACTION,
        default=d.min_top1_agreement,
        help=f"gate: least top-1 next-token agreement with FP32, 0..1 (default {d.min_top1_agreement})",
    )
    p.add_argument(
        "--max-kl",
        type=_NATS,
        default=d.max_kl,
        help=f"gate: largest mean KL(P_fp32 || P_quantized) in nats (default {d.max_kl})",
    )
    p.add_argument(
        "--min-cosine",
        type=_COSINE,
        default=d.min_cosine,
        help=f"gate for an encoder (--mode fp16): least cosine similarity of a prompt's FP32 and converted "
        f"mean-pooled vectors (default {d.min_cosine})",
    )
    p.add_argument(
        "--version", default=None, help="version of the new file (default: <version>-int8[-static][-sym])"
    )
    p.add_argument("--latency-rounds", type=_ROUNDS, default=d.latency_rounds,
                   help="timed runs per model for the report's latency comparison (default %(default)s)")
    p.add_argument(
        "--threads", type=_THREADS, default=d.intra_op_threads,
        help="ORT intra-op threads (0 = all cores; default %(default)s)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing quantized file")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    p.add_argument(
        "--publish", default=None, metavar="VERSION",
        help="push the INT8 result (with its card and report) to the model store as VERSION, e.g. 1.2.3-int8",
    )
    p.add_argument("--name", default=None, help="--publish: model name in the store (default: the card's name)")
    p.add_argument(
        "--config", default=None, help="--publish: YAML settings naming the store (default: $FLEET_CONFIG)"
    )
    p.set_defaults(func=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    """Run ``fleet quantize``; returns the exit status (0 written, 1 refused, 2 bad input)."""
    from protocol.errors import ModelLoadError
    from tools.quantize import QuantizationRefused, QuantizeConfig, quantize_model
    from tools.quantize_config import mode_for_target

    if args.min_tokens > args.max_tokens:
        print(f"fleet quantize: --min-tokens ({args.min_tokens}) must be <= --max-tokens ({args.max_tokens})",
              file=sys.stderr)
        return 2
    try:  # before anything is loaded: a refused target costs nothing
        mode, symmetric = mode_for_target(args.target, args.mode, args.symmetric)
    except ValueError as exc:
        print(f"fleet quantize: {exc}", file=sys.stderr)
        return 2
    cfg = QuantizeConfig(
        mode=mode,
        target=args.target,
        symmetric=symmetric,
        per_channel=args.per_channel,
        calibration_path=args.calibration,
        calibration_count=args.calibration_count,
        op_types=args.op_types or None,
        eval_path=args.eval_path,
        eval_count=args.eval_count,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        min_top1_agreement=args.min_top1_agreement,
        max_kl=args.max_kl,
        min_cosine=args.min_cosine,
        version=args.version,
        latency_rounds=args.latency_rounds,
        intra_op_threads=args.threads,
        overwrite=args.overwrite,
    )
    store = None
    if args.publish:  # a missing or bad store setting is found before the minutes of quantization
        from protocol.settings import load_settings
        from store.model_store import open_store

        store = open_store(load_settings(args.config).store)
    try:
        outcome = quantize_model(args.model, cfg, progress=not args.quiet)
    except QuantizationRefused as exc:
        print(json.dumps(exc.report))
        print(f"fleet quantize: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileExistsError, FileNotFoundError, ModelLoadError) as exc:
        print(f"fleet quantize: {exc}", file=sys.stderr)
        return 2
    published = None
    if store is not None and outcome.path is not None:
        from store.errors import StoreError

        try:
            published = _publish(store, outcome.path, args.publish, args.name)
        except StoreError as exc:
            print(json.dumps({**outcome.report, "published": None}))
            print(f"fleet quantize: wrote {outcome.path} but did not publish it: {exc}", file=sys.stderr)
            return 1
    print(json.dumps({**outcome.report, "published": published} if args.publish else outcome.report))
    rep = outcome.report
    acc = rep["accuracy"]
    figures = (f"smallest cosine similarity {acc['min_cosine']:.5f}" if "min_cosine" in acc
               else f"top-1 agreement {acc['top1_agreement']:.3f}, mean KL {acc['mean_kl']:.4f}")
    print(f"fleet quantize: wrote {outcome.path} ({rep['sizes']['ratio']:.0%} of FP32 size, {figures}, "
          f"{rep['latency']['speedup']:.2f}x FP32 speed)", file=sys.stderr)
    return 0


def _publish(store: ModelStore, path: Path, version: str, name: str | None) -> dict[str, Any]:
    """Push the quantized file's version to the store; its summary and manifest checksum."""
    from protocol.modelcard import load_card
    from store.manifest import manifest_digest

    model = name or load_card(path).name
    manifest = store.push(path, model, version)
    return {**manifest.summary(), "model": model, "store": store.location,
            "manifest_sha256": manifest_digest(store.manifest_bytes(model, version)),
            "paths": [f.path for f in manifest.files]}
