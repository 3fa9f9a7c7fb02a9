"""CLI glue for ``fleet soak`` (see :mod:`bench.soak`); ``register(subparsers)`` adds it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    """Run the soak; exit 1 when a request was lost or a finished request left a key without a TTL."""
    from bench.soak import SoakOptions, run_soak

    result = run_soak(SoakOptions(minutes=args.minutes, out=args.out, rate_per_s=args.rate,
                                  sample_every_s=args.sample_every, work_dir=args.work_dir))
    return 1 if result.lost or result.leftover_keys else 0


def register(sub: Any) -> None:
    """Add ``fleet soak`` to the ``fleet`` subcommands."""
    p = sub.add_parser("soak", help="run an embedded fleet under mixed traffic for N minutes; report memory and keys")
    p.add_argument("--minutes", type=float, default=30.0, help="how long the traffic runs (default 30)")
    p.add_argument("--out", type=Path, default=Path("docs/soak.md"),
                   help="the Markdown report (plot in img/ beside it; default %(default)s)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second, all kinds together (default 20)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between readings (default 10)")
    p.add_argument("--work-dir", type=Path, default=Path("var/soak"),
                   help="models, config and logs of the run (default %(default)s)")
    p.set_defaults(func=run)
