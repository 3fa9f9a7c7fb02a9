"""Serving fidelity with real tokenizers and model files, through every face.

One fleet for the module (real Redis, real workers, the gateway in-process):

* ``llama-chat`` — the demo LM with a Llama-style ``tokenizer.json`` (its post-processor prepends
  ``<s>``), a ``{{ bos_token }}`` chat template, and a ``generation_config.json`` that samples
  (temperature 0.7, top_k 7, top_p 0.9, repetition_penalty 1.3, max_new_tokens 5);
* ``raw-lm`` — the demo LM whose card says tokenizer ``none`` (token ids only);
* ``demo-encoder`` — for the embeddings route.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.deps import Gateway
from gateway.openai_routes import chat_prompt
from gateway.openai_schema import ChatBody
from producer.client import FleetClient
from protocol.messages import InferenceResult
from protocol.settings import load_settings
from protocol.tokenization import HFTokenizer
from tests.integration.fleet_fixtures import Fleet
from tests.unit.test_chat_tokens import MESSAGES, TEMPLATE, TRANSFORMERS_IDS
from tests.unit.tiny_tokenizers import sentencepiece_bpe
from tools.redis_server import EmbeddedRedis

TUNED = {"temperature": 0.7, "top_k": 7, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 5}
"""The sampling llama-chat's generation_config.json asks for (do_sample: true)."""
PROMPT = [40, 41, 42, 43]


@dataclass
class Served:
    fleet: Fleet
    config: Path
    client: FleetClient
    http: TestClient
    tokenizer: HFTokenizer


def _lm_copy(model_dir: Path, dest: Path, *, tokenizer: str) -> Path:
    """The demo LM's model file, card (with ``tokenizer``) and tokenizer_config.json in ``dest``."""
    source = model_dir / "demo-lm"
    dest.mkdir()
    model = dest / "demo-lm-1.0.0.onnx"
    shutil.copy(source / model.name, model)
    card = json.loads((source / "demo-lm-1.0.0.json").read_text())
    model.with_suffix(".json").write_text(json.dumps({**card, "tokenizer": tokenizer}))
    shutil.copy(source / "tokenizer_config.json", dest / "tokenizer_config.json")
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("fidelity")
    llama = _lm_copy(model_dir, root / "llama-chat", tokenizer="tokenizer.json")
    tokenizer = HFTokenizer(sentencepiece_bpe(llama.parent / "tokenizer.json", add_bos=True))
    (llama.parent / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))
    (llama.parent / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "do_sample": True, **TUNED}))
    raw = _lm_copy(model_dir, root / "raw-lm", tokenizer="none")
    with EmbeddedRedis() as server:
        fleet = Fleet(root, model_dir, server.url)
        try:
            models = {name: {"path": str(path), "engine": {"intra_op_threads": 1}, "limits": {"max_input_tokens": 128},
                             "batching": {"max_batch_size": 4}}
                      for name, path in (("llama-chat", llama), ("raw-lm", raw))}
            config = fleet.config(models={**models, "demo-encoder": {"batching": {"max_batch_size": 4}}})
            for model in ("llama-chat", "raw-lm", "demo-encoder"):
                fleet.worker(config, model=model, concurrency=4, wait=False)
            for worker in fleet.workers:
                worker.wait_ready(120)
            with TestClient(create_app(load_settings(config))) as http:
                yield Served(fleet, config, fleet.client(config), http, tokenizer)
        finally:
            fleet.close()


def _generated(served: Served, rid: str) -> list[int]:
    result = served.client.result(rid, wait=True, timeout_s=60)
    assert isinstance(result, InferenceResult) and result.generation is not None, result
    return result.generation.token_ids


def _error(answer: Any, status: int = 400) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    error: dict[str, Any] = answer.json()["error"]
    return error


# -- chat prompts: one BOS, as transformers ---------------------------------------------------------------
def test_a_chat_prompt_is_tokenized_as_transformers_does(served: Served) -> None:
    settings = load_settings(served.config)
    gateway = Gateway(settings, served.client)
    ids, text = chat_prompt(gateway, ChatBody(model="llama-chat", messages=MESSAGES))  # type: ignore[arg-type]
    assert (ids, text) == (TRANSFORMERS_IDS, None)
    answer = served.http.post("/v1/chat/completions", json={"model": "llama-chat", "messages": MESSAGES,
                                                            "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(TRANSFORMERS_IDS)  # one BOS, not two


# -- generation_config.json defaults on every face -----------------------------------------------------
def test_generation_config_defaults_apply_on_every_face(served: Served) -> None:
    client = served.client
    explicit = _generated(served, client.submit("llama-chat", PROMPT, generation={**TUNED, "ignore_eos": True}))
    greedy = _generated(served, client.submit("llama-chat", PROMPT, generation={**TUNED, "ignore_eos": True,
                                                                                "temperature": 0.0}))
    assert len(explicit) == TUNED["max_new_tokens"] and explicit != greedy, "the defaults must show in the tokens"

    faces: dict[str, list[int]] = {}
    faces["FleetClient"] = _generated(served, client.submit("llama-chat", PROMPT, generation={"ignore_eos": True}))
    native = served.http.post("/v1/requests", json={"model": "llama-chat", "input_ids": PROMPT,
                                                    "output": {"generation": {"ignore_eos": True}}})
    assert native.status_code in (200, 202), native.text
    faces["POST /v1/requests"] = _generated(served, native.json()["request_id"])
    cli = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", "--model", "llama-chat", "--tokens",
         ",".join(map(str, PROMPT)), "--ignore-eos", "--wait"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "FLEET_CONFIG": str(served.config)},
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    faces["fleet submit"] = json.loads(cli.stdout)["generation"]["token_ids"]
    for face, ids in faces.items():
        assert ids == explicit, f"{face} did not apply generation_config.json: {ids} != {explicit}"

    completion = served.http.post("/v1/completions", json={"model": "llama-chat", "prompt": PROMPT,
                                                           "ignore_eos": True})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == TUNED["max_new_tokens"]
    assert _generated(served, completion.headers["X-Request-ID"]) == explicit, "OpenAI completions"

    chat_ref = _generated(served, client.submit("llama-chat", TRANSFORMERS_IDS,
                                                generation={**TUNED, "ignore_eos": True}))
    chat = served.http.post("/v1/chat/completions", json={"model": "llama-chat", "messages": MESSAGES,
                                                          "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == TUNED["max_new_tokens"]
    assert _generated(served, chat.headers["X-Request-ID"]) == chat_ref, "OpenAI chat"


# -- a model without a tokenizer never answers "" ------------------------------------------------------
def test_a_model_without_tokenizer_says_so_on_the_openai_routes(served: Served) -> None:
    for stream in (False, True):
        error = _error(served.http.post("/v1/completions", json={"model": "raw-lm", "prompt": PROMPT,
                                                                 "max_tokens": 3, "stream": stream}))
        assert error["param"] == "model" and "no tokenizer" in error["message"], error
    error = _error(served.http.post("/v1/chat/completions", json={"model": "raw-lm", "messages": MESSAGES}))
    assert error["param"] == "model" and "no tokenizer" in error["message"], error
    # the native route still serves it: the ids are the answer
    assert len(_generated(served, served.client.submit("raw-lm", PROMPT, generation={"max_new_tokens": 3,
                                                                                      "ignore_eos": True}))) == 3


# -- errors name the caller's fields ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100_000}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100_000}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 100_000}, "max_completion_tokens"),
    ],
)
def test_openai_errors_name_the_callers_field(served: Served, route: str, body: dict[str, Any], param: str) -> None:
    error = _error(served.http.post(route, json={"model": "llama-chat", **body}))
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param} = 100000"), error
    assert "output.generation" not in error["message"], error


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"model": "llama-chat", "prompt": [5, 99_999]}, "prompt[1]"),
        ("/v1/completions", {"model": "llama-chat", "prompt": [[5, 99_999]]}, "prompt[0][1]"),
        ("/v1/embeddings", {"model": "demo-encoder", "input": [5, 99_999]}, "input[1]"),
        ("/v1/embeddings", {"model": "demo-encoder", "input": [[5], [5, 99_999]]}, "input[1][1]"),
        ("/v1/embeddings", {"model": "demo-encoder", "input": [[5, 99_999]]}, "input[0][1]"),
    ],
)
def test_a_bad_token_is_named_where_the_caller_put_it(served: Served, route: str, body: dict[str, Any],
                                                      param: str) -> None:
    error = _error(served.http.post(route, json=body))
    assert error["param"] == param and error["message"].startswith(f"{param} = 99999"), error


@pytest.mark.parametrize(
    ("given", "param"), [("", "input"), ([], "input"), (["a", ""], "input[1]"), ([[]], "input[0]")]
)
def test_an_empty_embeddings_input_is_refused_naming_it(served: Served, given: Any, param: str) -> None:
    error = _error(served.http.post("/v1/embeddings", json={"model": "demo-encoder", "input": given}))
    assert error["param"] == param and "empty" in error["message"], error
    ok = served.http.post("/v1/embeddings", json={"model": "demo-encoder", "input": ["a"]})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1, ok.text
