"""Text in, end to end: a tokenizer.json's own padding/truncation never reaches the model, text that is not
valid Unicode is refused (client and HTTP gateway), and a model without a tokenizer refuses text but serves ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from tokenizers import Tokenizer as LibTokenizer

from gateway.app import create_app
from protocol.errors import InputTooLong, InvalidRequest
from protocol.messages import InferenceRequest, InferenceResult, OutputSpec
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet

SHORT = "The queue grows, and nothing is lost."
LONG = "Adding another worker on another machine drains the queue faster. " * 4  # ~50 tokens


def _sentence_transformers_copy(model_dir: Path, dest: Path) -> tuple[Path, LibTokenizer]:
    """The demo encoder copied to ``dest`` with its tokenizer.json padding to and truncating at 128, as a
    sentence-transformers export does; returns the model path and the original (plain) tokenizer."""
    src = model_dir / "demo-encoder"
    shutil.copytree(src, dest)
    tok_file = dest / "demo-encoder-1.0.0.tokenizer.json"
    plain = LibTokenizer.from_file(str(tok_file))
    padded = LibTokenizer.from_file(str(tok_file))
    padded.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
    padded.enable_truncation(128)
    padded.save(str(tok_file))
    assert len(LibTokenizer.from_file(str(tok_file)).encode(SHORT).ids) == 128
    return dest / "demo-encoder-1.0.0.onnx", plain


def _ok(result: object) -> InferenceResult:
    assert isinstance(result, InferenceResult), result
    return result


def test_padded_tokenizer_file_gives_real_tokens_and_reported_truncation(fleet: Fleet) -> None:
    path, plain = _sentence_transformers_copy(fleet.model_dir, fleet.tmp_path / "st")
    cfg = fleet.config(models={"demo-encoder": {"path": str(path), "limits": {"max_input_tokens": 16,
                                                                             "truncate": "right"}}},
                       worker={"model": "demo-encoder"})
    fleet.worker(cfg, model="demo-encoder")
    client = fleet.client(cfg)
    short_ids = plain.encode(SHORT).ids
    assert 4 < len(short_ids) <= 16

    by_text = _ok(client.result(client.submit("demo-encoder", text=SHORT), wait=True, timeout_s=30))
    by_ids = _ok(client.result(client.submit("demo-encoder", short_ids), wait=True, timeout_s=30))
    assert (by_text.input_tokens, by_text.truncated) == (len(short_ids), False)
    np.testing.assert_allclose(by_text.embedding or [], by_ids.embedding or [], atol=1e-6)

    long_ids = plain.encode(LONG).ids
    assert len(long_ids) > 16
    assert client.build_request("demo-encoder", text=LONG).input_ids == long_ids[:16]  # 'right': the first 16
    # the worker truncates and reports it (a request that reaches it over-long)
    raw = InferenceRequest(model="demo-encoder", input_ids=long_ids, output=OutputSpec(kind="embedding"),
                           request_id="long-raw")
    cut = _ok(client.result(client.send(raw), wait=True, timeout_s=30))
    first16 = _ok(client.result(client.submit("demo-encoder", long_ids[:16]), wait=True, timeout_s=30))
    assert (cut.input_tokens, cut.truncated, first16.truncated) == (16, True, False)
    np.testing.assert_allclose(cut.embedding or [], first16.embedding or [], atol=1e-6)


def test_producer_side_truncation_reaches_the_result(fleet: Fleet) -> None:
    path, _ = _sentence_transformers_copy(fleet.model_dir, fleet.tmp_path / "st")
    cfg = fleet.config(models={"demo-encoder": {"path": str(path), "limits": {"max_input_tokens": 16,
                                                                             "truncate": "left"}}})
    request = fleet.client(cfg).build_request("demo-encoder", text=LONG)
    # either the ids travel whole (the worker cuts and reports) or the request says it was cut
    assert len(request.input_ids) > 16 or getattr(request, "truncated", False)


def test_over_long_text_is_refused_when_truncate_is_none(fleet: Fleet) -> None:
    path, _ = _sentence_transformers_copy(fleet.model_dir, fleet.tmp_path / "st")
    cfg = fleet.config(models={"demo-encoder": {"path": str(path), "limits": {"max_input_tokens": 16}}})
    with pytest.raises(InputTooLong, match="max_input_tokens=16") as info:
        fleet.client(cfg).submit("demo-encoder", text=LONG)
    assert (info.value.field, info.value.limit) == ("text", 16)  # named as the caller sent it
    assert str(info.value).startswith("text has ")
    assert redis.Redis.from_url(fleet.redis_url).llen("fleet.demo-encoder") == 0


@pytest.mark.parametrize("model", ["demo-lm", "demo-encoder"])  # byte and WordPiece tokenizers
def test_lone_surrogate_is_refused_by_client_and_gateway(fleet: Fleet, model: str) -> None:
    cfg = fleet.config()
    with pytest.raises(InvalidRequest, match="lone surrogate U\\+D800") as info:
        fleet.client(cfg).submit(model, text="\ud800abc")
    assert info.value.field == "text"
    with TestClient(create_app(load_settings(cfg))) as http:
        body = json.dumps({"model": model, "text": "@"}).replace("@", "\\ud800abc")  # JSON escape, unpaired
        answer = http.post("/v1/requests", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    doc = answer.json()
    assert (doc["type"], doc["field"]) == ("InvalidRequest", "text") and "U+D800" in doc["message"]
    assert redis.Redis.from_url(fleet.redis_url).llen(f"fleet.{model}") == 0


def test_card_less_model_without_tokenizer_refuses_text_and_serves_ids(fleet: Fleet) -> None:
    folder = fleet.tmp_path / "hf-lm"
    folder.mkdir()
    shutil.copy(fleet.model_dir / "demo-lm" / "demo-lm-1.0.0.onnx", folder / "model.onnx")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 512, "n_embd": 64,
        "n_head": 4, "n_layer": 2, "n_positions": 512, "bos_token_id": 1, "eos_token_id": 2}))  # fmt: skip
    cfg = fleet.config(models={"hf-lm": {"path": str(folder / "model.onnx"), "version": "2.0.0",
                                         "engine": {"intra_op_threads": 1}}},
                       worker={"model": "hf-lm"})
    client = fleet.client(cfg)
    with pytest.raises(InvalidRequest) as info:
        client.submit("hf-lm", text="hello")
    assert info.value.field == "text"
    fleet.worker(cfg, model="hf-lm")
    result = _ok(client.result(client.submit("hf-lm", [104, 105], top_k=3), wait=True, timeout_s=30))
    assert (result.model, result.version, result.kind, result.input_tokens) == ("hf-lm", "2.0.0", "next_token", 2)
