"""The official ``openai`` SDK, unchanged, against a real gateway: completions, chat, embeddings, models,
errors in OpenAI's shape, and the request ID that lets a caller poll the native API."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from tests.integration.openai_fixtures import API_KEY, Served, ops_models, ops_redis, served

__all__ = ["ops_models", "ops_redis", "served"]

NO_EOS = {"ignore_eos": True}  # the random demo LM may emit EOS at any step; these tests want exact lengths


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"demo-lm", "demo-encoder", "plain-lm"}
    lm = models["demo-lm"]
    assert lm.object == "model" and lm.owned_by == "onnx-fleet" and lm.created > 0
    extra: dict[str, Any] = lm.model_extra or {}
    assert extra["ready"] is True and extra["served_versions"] == ["1.0.0"] and extra["queue"] == "fleet.demo-lm"
    assert extra["max_input_tokens"] == 64 and extra["max_new_tokens"] == 256
    assert (models["plain-lm"].model_extra or {})["ready"] is False
    assert client.models.retrieve("demo-encoder").id == "demo-encoder"
    assert client.models.retrieve("DEMO_ENCODER").id == "demo-encoder"  # named as every other route names it
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["param"] == "model"  # type: ignore[index]


def test_a_route_of_openai_s_the_fleet_lacks_is_a_404_the_sdk_reads(client: openai.OpenAI) -> None:
    """Before, ``/v1/files`` and the like answered the native 404 shape (``"error": "not_found"``, a string), so
    the SDK's error carried the whole body as its message and no ``code``."""
    with pytest.raises(openai.NotFoundError) as info:
        client.files.list()
    assert info.value.code == "not_found" and info.value.message == "Error code: 404 - Not Found", info.value.body
    assert info.value.body == {"message": "Not Found", "type": "invalid_request_error", "param": None,
                               "code": "not_found"}  # fmt: skip


def test_completion_text_and_token_prompt(served: Served, client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model="demo-lm", prompt="Hello fleet", max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    rid = raw.headers["x-request-id"]
    done = raw.parse()
    assert done.id == f"cmpl-{rid}" and done.object == "text_completion" and done.model == "demo-lm"
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0
    assert done.usage is not None and done.usage.prompt_tokens == len(b"Hello fleet")
    assert done.usage.completion_tokens == 8 and done.usage.total_tokens == len(b"Hello fleet") + 8
    native = served.finished(rid)  # the same request, polled by ID through the native API
    assert native["status"] == "succeeded" and native["result"]["generation"]["text"] == choice.text

    by_ids = client.completions.create(
        model="demo-lm", prompt=[b + 3 for b in b"Hello fleet"], max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert by_ids.choices[0].text == choice.text  # the byte tokenizer: the same ids, greedy, the same text


def test_seeded_sampling_repeats_and_stop_strings_map(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model="demo-lm", prompt="abc", max_tokens=12, temperature=0.9, top_p=0.95, seed=seed, extra_body=NO_EOS
        )
        return out.choices[0].text

    assert sample(7) == sample(7)
    assert sample(-1) == sample(2**63 - 1)  # OpenAI's seeds are any int64: a negative one is taken mod 2**63
    greedy = client.completions.create(model="demo-lm", prompt="abc", max_tokens=12, temperature=0, extra_body=NO_EOS)
    text = greedy.choices[0].text
    stop = next((text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].isprintable()), None)
    assert stop is not None, f"greedy text {text!r} has no printable pair to stop on: nothing to check"
    cut = client.completions.create(
        model="demo-lm", prompt="abc", max_tokens=12, temperature=0, stop=[stop], extra_body=NO_EOS
    )
    assert cut.choices[0].finish_reason == "stop" and text.startswith(cut.choices[0].text)
    assert stop not in cut.choices[0].text


def test_chat_renders_the_model_template(served: Served, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="demo-lm",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        extra_body=NO_EOS,
    )
    done = raw.parse()
    rid = raw.headers["x-request-id"]
    assert done.id == f"chatcmpl-{rid}" and done.object == "chat.completion"
    message = done.choices[0].message
    assert message.role == "assistant" and done.choices[0].finish_reason == "length"
    rendered = "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"  # tools.generation_assets
    assert done.usage is not None and done.usage.prompt_tokens == len(rendered.encode())
    assert served.finished(rid)["result"]["generation"]["text"] == message.content
    parts = client.chat.completions.create(
        model="demo-lm",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "Hi"},
        ],
        max_tokens=6,
        temperature=0,
        extra_body=NO_EOS,
    )
    assert parts.choices[0].message.content == message.content  # text parts joined: the same prompt


def test_chat_default_length_comes_from_the_model(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model="demo-lm", messages=[{"role": "user", "content": "Hi"}], temperature=0, extra_body=NO_EOS
    )
    assert done.usage is not None and done.usage.completion_tokens == 64  # generation_config.json's max_new_tokens


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def test_embeddings_float_and_base64(served: Served, client: openai.OpenAI) -> None:
    raw = client.embeddings.with_raw_response.create(model="demo-encoder", input=["first text", "second"])
    ids = raw.headers["x-request-id"].split(",")
    as_b64 = raw.parse()  # the SDK asks for base64 and decodes it
    as_float = client.embeddings.create(model="demo-encoder", input=["first text", "second"], encoding_format="float")
    assert len(ids) == 2 and [d.index for d in as_b64.data] == [0, 1]
    assert as_b64.usage.prompt_tokens == as_float.usage.prompt_tokens > 0
    for packed, plain in zip(as_b64.data, as_float.data, strict=True):
        assert len(packed.embedding) == len(plain.embedding) > 0
        assert max(abs(a - b) for a, b in zip(packed.embedding, plain.embedding, strict=True)) < 1e-6
        assert abs(_norm(plain.embedding) - 1) < 1e-4
    stored = served.finished(ids[0])["result"]["embedding"]
    assert max(abs(a - b) for a, b in zip(stored, as_float.data[0].embedding, strict=True)) < 1e-6
    by_ids = client.embeddings.create(model="demo-encoder", input=[5, 6, 7], encoding_format="float")
    assert len(by_ids.data) == 1 and by_ids.usage.prompt_tokens == 3


@pytest.mark.parametrize(
    ("call", "status", "param", "words"),
    [
        ({"n": 2}, 400, "n", "n=1"),
        ({"frequency_penalty": 0.5}, 400, "frequency_penalty", "repetition_penalty"),
        ({"presence_penalty": 1.0}, 400, "presence_penalty", "only 0"),
        ({"logprobs": 2}, 400, "logprobs", "not supported"),
        ({"max_tokens": 100_000}, 400, "max_tokens", "max_new_tokens=256"),
        ({"prompt": "x" * 65}, 400, "prompt", "max_input_tokens=64"),
        ({"prompt": ["one", "two"]}, 400, "prompt", "one prompt per request"),
        ({"temperature": 3}, 400, "temperature", "less than or equal to 2"),
        ({"model": "demo-encoder"}, 400, "model", "model 'demo-encoder' cannot generate text: an encoder model"),
        ({"model": "no-such-model"}, 404, "model", "no-such-model"),
        ({"bogus_field": 1}, 400, "bogus_field", "Extra inputs are not permitted"),
        # a JSON true or a numeric string is no number: before, true sampled at temperature 1
        ({"temperature": True}, 400, "temperature", "valid number"),
        ({"top_p": "0.5"}, 400, "top_p", "valid number"),
        ({"repetition_penalty": True}, 400, "repetition_penalty", "valid number"),
        # a field of several forms is named as sent (before: "prompt.str", "Input should be a valid string")
        ({"prompt": [1, "a"]}, 400, "prompt", "none of its accepted forms"),
        ({"stop": 5}, 400, "stop", "none of its accepted forms (str, list[str])"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed when stream is true"),
        ({"stop_token_ids": [512]}, 400, "stop_token_ids[0]", "outside the vocabulary [0, 512)"),
        ({"stop_token_ids": [-1]}, 400, "stop_token_ids[0]", "outside the vocabulary [0, 512)"),
        ({"seed": 2**63}, 400, "seed", "less than 9223372036854775808"),
    ],
)
def test_completion_refusals_name_the_field(
    client: openai.OpenAI, call: dict[str, Any], status: int, param: str, words: str
) -> None:
    args: dict[str, Any] = {"model": "demo-lm", "prompt": "Hi", "max_tokens": 4}
    extra = {k: call.pop(k) for k in list(call) if k in ("bogus_field", "repetition_penalty", "stop_token_ids")}
    args.update(call)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**args, extra_body=extra or None)
    err = info.value
    assert err.status_code == status, err.body
    body: dict[str, Any] = err.body  # type: ignore[assignment]
    assert body["param"] == param and words in body["message"], body
    assert body["type"] == ("invalid_request_error" if status in (400, 404) else body["type"]) and body["code"]


def test_chat_refusals_name_the_field(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"model": "plain-lm"}, "messages", "no chat template"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type", "only text parts"),
        ({"max_completion_tokens": 100_000}, "max_completion_tokens", "max_new_tokens=256"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "required for a 'user' message"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "none of its accepted forms"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
         "valid string"),
    ]
    for extra, param, words in cases:
        args: dict[str, Any] = {"model": "demo-lm", "messages": [{"role": "user", "content": "Hi"}], **extra}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**args)
        body: dict[str, Any] = info.value.body  # type: ignore[assignment]
        assert body["param"] == param and words in body["message"], (extra, body)


def test_embedding_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="demo-lm", input="hi")
    assert info.value.body["param"] == "model"  # type: ignore[index]
    assert info.value.body["message"].startswith("model 'demo-lm' cannot embed: a causal_lm model")  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="demo-encoder", input=["ok", "x" * 65])
    assert info.value.body["param"] == "input[1]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="demo-encoder", input="hi", dimensions=8)
    assert info.value.body["param"] == "dimensions"  # type: ignore[index]


def test_keys_bearer_or_x_api_key_on_both_faces(served: Served) -> None:
    wrong = openai.OpenAI(base_url=served.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    assert body["type"] == "authentication_error" and "Bearer" in body["message"]
    url = served.gateway.url
    assert httpx.get(url + "/v1/models", headers={"X-API-Key": API_KEY}).status_code == 200
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    native = httpx.post(url + "/v1/requests", headers=bearer, json={"model": "demo-lm", "input_ids": [5, 6]})
    assert native.status_code == 202
    nobody = httpx.post(url + "/v1/completions", json={"model": "demo-lm", "prompt": "x"})
    assert nobody.status_code == 401 and nobody.json()["error"]["type"] == "authentication_error"


def test_body_limit_in_openai_shape(served: Served) -> None:
    big = {"model": "demo-lm", "prompt": "x" * 70_000}
    resp = served.http.post("/v1/completions", json=big)
    assert resp.status_code == 413 and resp.json()["error"]["param"] == "body"
    assert "api.max_body_bytes=65536" in resp.json()["error"]["message"]
