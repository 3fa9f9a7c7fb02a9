"""``fleet build-model``: build the fleet's models from presets, with per-flag overrides.

Presets (``--preset``), each one set of sizes per kind (``--kind``):

* ``demo`` — ``demo-lm`` (GPT-2 style, 2 layers, hidden 64, 4 heads, vocab 512, ~0.2 M weights),
  ``demo-llama`` (Llama style, same sizes with 2 KV heads), ``demo-encoder`` (same sizes, vocab 1024,
  WordPiece tokenizer) and ``identity`` (vocab 512); all four build in well under a second.
* ``bench`` — ``bench-lm`` (6 layers, hidden 512, 8 heads, vocab 8192, 512 positions, ~27.6 M weights),
  ``bench-llama`` (same sizes, 2 KV heads, ~25 M weights), ``bench-encoder`` (same sizes) and
  ``bench-identity`` (vocab 8192, for the queue's own cost).

The two causal-LM kinds are the two layouts of optimum's decoder exports: ``lm`` (GPT-2: learned
positions, past inputs second) and ``llama`` (rotary positions, grouped-query attention, past inputs
last); both folders also get ``generation_config.json`` and ``tokenizer_config.json`` (chat template).
``--kind all`` (the default) builds every kind of the preset. Run it as
``python -m tools.build_model --preset bench`` or through the ``fleet`` CLI.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from producer.cli_types import number_in
from protocol.errors import ConfigError
from protocol.modelcard import load_card

__all__ = ["KINDS", "PRESETS", "add_build_model_arguments", "main", "preset_parameter_count",
           "run_build_model"]

KINDS = ("lm", "llama", "encoder", "identity")
"""What ``--kind`` can name (besides ``all``)."""

_DEMO_SIZES: dict[str, Any] = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "max_positions": 512}
_BENCH_SIZES: dict[str, Any] = {"num_layers": 6, "hidden_size": 512, "num_heads": 8, "max_positions": 512}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "demo": {
        "lm": {"name": "demo-lm", **_DEMO_SIZES, "vocab_size": 512},
        "llama": {"name": "demo-llama", **_DEMO_SIZES, "num_kv_heads": 2, "vocab_size": 512},
        "encoder": {"name": "demo-encoder", **_DEMO_SIZES, "vocab_size": 1024},
        "identity": {"name": "identity", "vocab_size": 512},
    },
    "bench": {
        "lm": {"name": "bench-lm", **_BENCH_SIZES, "vocab_size": 8192},
        "llama": {"name": "bench-llama", **_BENCH_SIZES, "num_kv_heads": 2, "vocab_size": 8192},
        "encoder": {"name": "bench-encoder", **_BENCH_SIZES, "vocab_size": 8192},
        "identity": {"name": "bench-identity", "vocab_size": 8192},
    },
}
"""Keyword arguments of the builder of each kind, per preset (``version`` and ``seed`` use defaults)."""

def _builder(kind: str) -> Callable[..., Path]:
    """The builder of ``kind``, imported on use: onnx takes ~1 s to import, and every ``fleet``
    command builds this module's parser."""
    if kind == "lm":
        from tools.build_lm import build_causal_lm

        return build_causal_lm
    if kind == "llama":
        from tools.build_llama import build_llama

        return build_llama
    if kind == "encoder":
        from tools.build_encoder import build_encoder

        return build_encoder
    from tools.build_identity import build_identity

    return build_identity

# CLI flag (argparse dest) -> builder keyword, and the kinds that take it.
_OVERRIDES: dict[str, tuple[str, tuple[str, ...]]] = {
    "name": ("name", KINDS),
    "version": ("version", KINDS),
    "layers": ("num_layers", ("lm", "llama", "encoder")),
    "hidden": ("hidden_size", ("lm", "llama", "encoder")),
    "heads": ("num_heads", ("lm", "llama", "encoder")),
    "kv_heads": ("num_kv_heads", ("llama",)),
    "vocab": ("vocab_size", KINDS),
    "max_positions": ("max_positions", KINDS),
    "seed": ("seed", ("lm", "llama", "encoder")),
}


_SIZE = number_in(int, 1, math.inf, "must be an integer >= 1")
"""argparse type of every size flag (--layers, --hidden, --heads, --kv-heads, --vocab, --max-positions): 0 divided
by zero in a builder, a negative one reached numpy ("negative dimensions are not allowed", naming no flag)."""
_SEED = number_in(int, 0, math.inf, "must be an integer >= 0")
"""argparse type of --seed (numpy's generators take no negative seed)."""


def preset_parameter_count(preset: str, kind: str) -> int:
    """Number of weights of ``kind`` in ``preset``, computed from the sizes without building.

    Raises:
        KeyError: unknown preset or kind.
    """
    spec = {k: v for k, v in PRESETS[preset][kind].items() if k != "name"}
    if kind == "llama":
        from tools.build_llama import llama_parameter_count

        return llama_parameter_count(**spec)
    spec.pop("num_heads", None)
    if kind == "lm":
        from tools.build_lm import causal_lm_parameter_count

        return causal_lm_parameter_count(**spec)
    if kind == "encoder":
        from tools.build_encoder import encoder_parameter_count

        return encoder_parameter_count(**spec)
    return 0


def add_build_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``build-model`` flags to ``parser`` (see :func:`run_build_model`)."""
    parser.add_argument("--out-dir", type=Path, default=Path("models"),
                        help="model store root: writes OUT_DIR/NAME/NAME-VERSION.onnx (default: models)")
    parser.add_argument("--kind", choices=[*KINDS, "all"], default="all",
                        help="which model to build: lm (GPT-2 style), llama (Llama style), encoder, identity "
                        "(default: all of them)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                        help="size preset (default: demo, builds in about a second; bench: ~25-28 M weights per LM)")
    parser.add_argument("--name", help="model name (only with a single --kind)")
    parser.add_argument("--version", help="model version (default: 1.0.0)")
    parser.add_argument("--layers", type=_SIZE, help="number of transformer blocks")
    parser.add_argument("--hidden", type=_SIZE, help="hidden size (width)")
    parser.add_argument("--heads", type=_SIZE, help="attention heads (must divide --hidden)")
    parser.add_argument("--kv-heads", type=_SIZE, help="llama only: KV heads (must divide --heads; default: 2)")
    parser.add_argument("--vocab", type=_SIZE, help="vocabulary size (>= 259 for the byte tokenizer)")
    parser.add_argument("--max-positions", type=_SIZE, help="longest past + sequence length (tokens)")
    parser.add_argument("--seed", type=_SEED, help="weight seed (default: 0)")


def _specs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(kind, builder keyword arguments) for every model ``args`` asks for."""
    kinds = list(KINDS) if args.kind == "all" else [args.kind]
    if args.name is not None and len(kinds) > 1:
        raise ConfigError(f"--name needs a single --kind ({', '.join(KINDS)})", "--name", "a single --kind")
    specs = []
    for kind in kinds:
        spec = dict(PRESETS[args.preset][kind])
        for flag, (keyword, takers) in _OVERRIDES.items():
            value = getattr(args, flag, None)
            if value is not None and kind in takers:
                spec[keyword] = value
        specs.append((kind, spec))
    return specs


def run_build_model(args: argparse.Namespace) -> list[Path]:
    """Build the models ``args`` asks for; print one line per model; return their ``.onnx`` paths.

    Each line: path, number of weights, file size (MiB), build time (s).

    Raises:
        ConfigError: inconsistent flags or sizes (e.g. ``--name`` with ``--kind all``, a vocabulary
            too small for the tokenizer, heads not dividing the hidden size), the flags named: exit 2.
    """
    paths = []
    for kind, spec in _specs(args):
        start_s = time.monotonic()
        try:
            path = _builder(kind)(Path(args.out_dir), **spec)
        except ValueError as exc:  # the builders check their sizes before writing anything
            raise _in_flag_words(exc) from exc
        elapsed_s = time.monotonic() - start_s
        size_mib = path.stat().st_size / 2**20
        params = load_card(path).parameters
        print(f"{path}  {kind:<8} {params / 1e6:8.2f} M weights  {size_mib:8.2f} MiB  {elapsed_s:6.2f} s")
        paths.append(path)
    return paths


def _in_flag_words(exc: ValueError) -> ConfigError:
    """A builder's refusal, which names its keywords (``num_heads=7``), in the words of the flags (``--heads=7``)."""
    message, named = str(exc), []
    for flag, (keyword, _) in _OVERRIDES.items():
        pattern = rf"\b{keyword}\b"
        if re.search(pattern, message):
            named.append(f"--{flag.replace('_', '-')}")
            message = re.sub(pattern, named[-1], message)
    return ConfigError(message, named[0] if named else None, None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m tools.build_model``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tools.build_model", description=__doc__.split("\n")[0])
    add_build_model_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run_build_model(args)
    except ConfigError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
