"""What ``FleetClient`` makes of its callers' arguments before anything is queued: a model card learnt late,
numpy integers, inputs of the wrong type, bad timeouts, batch errors that name their input. Pure logic: the
client's Redis is a stub holding only what the calls read (a card), and nothing is sent."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from producer.client import CARD_MISS_TTL_S, FleetClient
from producer.streams import StreamCursor
from protocol.errors import EmptyInput, InvalidRequest, TokenOutOfRange
from protocol.keys import CARD_KEY
from protocol.modelcard import ModelCard
from protocol.settings import load_settings

CARD = ModelCard(name="m", version="1", kind="causal_lm", vocab_size=300, max_positions=512, num_layers=1,
                 num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, tokenizer="byte")  # fmt: skip


class StubRedis:
    """The commands building a request reads: GET of a model's card."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.gets = 0

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        return self.values.get(key)

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def client(tmp_path: Path) -> Iterator[FleetClient]:
    """A client of model ``m``, whose file is not on this machine; its card is in (stub) Redis."""
    settings = load_settings("/dev/null", redis_url="redis://127.0.0.1:1/0",
                             models={"m": {"path": str(tmp_path / "absent.onnx"), "max_queue_depth": 10,
                                           "limits": {"max_input_tokens": 64, "max_new_tokens": 32}}})  # fmt: skip
    c = FleetClient(settings)
    stub = StubRedis()
    stub.values[CARD_KEY.format(model="m")] = CARD.model_dump_json().encode()
    real, c.redis = c.redis, stub  # type: ignore[assignment]
    c.monotonic = Clock()
    try:
        yield c
    finally:
        c.redis = real
        c.close()


def _stub(c: FleetClient) -> StubRedis:
    assert isinstance(c.redis, StubRedis)
    return c.redis


# -- 3: a card published after the client's first look is learnt ------------------------------------------------
def test_a_missing_card_is_looked_for_again_after_its_ttl(client: FleetClient) -> None:
    """A service started before the model's workers: no card at first (ids are not checked, text is refused);
    once the workers published it, the client learns it within CARD_MISS_TTL_S (before: never, until restarted)."""
    card = _stub(client).values.pop(CARD_KEY.format(model="m"))
    assert client.model_card("m") is None and client.model_loaded("m")
    assert client.build_request("m", [299, 300_000]).input_ids == [299, 300_000]  # unchecked: no card
    _stub(client).values[CARD_KEY.format(model="m")] = card  # a worker of m started
    gets = _stub(client).gets
    assert client.model_card("m") is None and _stub(client).gets == gets  # a miss is kept for its TTL: no read
    assert isinstance(client.monotonic, Clock)
    client.monotonic.now_s += CARD_MISS_TTL_S
    assert not client.model_loaded("m")  # building a request would read Redis: not on an event loop
    assert client.model_card("m") == CARD
    assert client.build_request("m", text="hi").input_ids  # the byte tokenizer of the card
    client.monotonic.now_s += 10 * CARD_MISS_TTL_S
    assert client.model_card("m") == CARD and client.model_loaded("m")  # a card found is kept
    assert _stub(client).gets == gets + 1


# -- 7: a batch error names its input ------------------------------------------------------------------------
def test_a_bad_input_of_a_batch_is_named_by_its_position(client: FleetClient) -> None:
    """The gateway names ``requests[i]``; the client named only the field (``input_ids[1]``), not which of
    5,001 inputs held it."""
    inputs = [[1, 2]] * 4000 + [[1, 99_999]] + [[1, 2]] * 1000
    with pytest.raises(TokenOutOfRange) as info:
        client.submit_bulk("m", inputs)
    assert info.value.field == "inputs[4000].input_ids[1]" and info.value.limit == 300
    assert info.value.message.startswith("inputs[4000]: input_ids[1] = 99999 is outside the vocabulary")
    with pytest.raises(EmptyInput) as empty:
        client.submit_many("m", [[1], [2], [3], []], progress=False)
    assert empty.value.field == "inputs[3].input_ids" and "inputs[3]" in empty.value.message
    with pytest.raises(InvalidRequest) as text:
        client.submit_many("m", [[1], "x" * 10_000], progress=False)
    assert text.value.field == "inputs[1].text"


# -- 8: numpy integers are integers ---------------------------------------------------------------------------
def test_numpy_integers_are_taken_and_sent_as_plain_ints(client: FleetClient) -> None:
    request = client.build_request("m", np.array([5, 6, 7]), top_k=np.int64(3))
    assert request.input_ids == [5, 6, 7] and all(type(t) is int for t in request.input_ids)
    assert request.output.top_k == 3 and type(request.output.top_k) is int
    assert client.build_request("m", list(np.array([5, 6], dtype=np.int32))).input_ids == [5, 6]
    gen = client.build_request("m", [5, 6], generation={"max_new_tokens": np.int64(4),
                                                        "stop_token_ids": np.array([1, 2])})  # fmt: skip
    assert gen.output.generation is not None
    assert (gen.output.generation.max_new_tokens, gen.output.generation.stop_token_ids) == (4, [1, 2])
    assert json.loads(gen.model_dump_json())["input_ids"] == [5, 6]  # what is sent: plain JSON numbers


@pytest.mark.parametrize("bad", [np.float64(5.0), 5.0, True, np.bool_(True), "5", None])
def test_an_id_that_is_not_an_integer_is_refused_by_position(client: FleetClient, bad: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        client.build_request("m", [1, bad])
    assert info.value.field == "input_ids[1]" and info.value.limit == "integer"


# -- 9: text is not token ids, a string is not a list of inputs ------------------------------------------------
@pytest.mark.parametrize("ids", [b"Hello", bytearray(b"Hello"), "Hello"])
def test_bytes_or_a_str_as_input_ids_are_refused_not_read_as_ids(client: FleetClient, ids: Any) -> None:
    """b"Hello" was queued as the token ids [72, 101, 108, 108, 111]."""
    with pytest.raises(InvalidRequest) as info:
        client.build_request("m", ids)
    assert info.value.field == "input_ids" and "text=" in info.value.message


@pytest.mark.parametrize("call", ["submit_bulk", "submit_many"])
@pytest.mark.parametrize("inputs", ["hello", b"hello", 5])
def test_a_str_as_the_inputs_is_refused_not_split_into_characters(client: FleetClient, call: str,
                                                                  inputs: Any) -> None:  # fmt: skip
    """submit_bulk("m", "hello") queued 5 one-character requests."""
    with pytest.raises(InvalidRequest) as info:
        getattr(client, call)("m", inputs)
    assert info.value.field == "inputs"


# -- 10: a chunk that can never pass the queue's cap -----------------------------------------------------------
def test_a_chunk_larger_than_the_queue_cap_is_refused_up_front(client: FleetClient) -> None:
    """On an empty queue of cap 10, a chunk of 11 was QueueFull "retry after 60 s": a retry loop spun forever."""
    with pytest.raises(InvalidRequest) as info:
        client.submit_bulk("m", [[i + 1, 3] for i in range(11)], chunk_size=100)
    assert type(info.value) is InvalidRequest and info.value.field == "chunk_size" and info.value.limit == 10
    assert "max_queue_depth=10" in info.value.message


# -- 11: arguments of the wrong type are InvalidRequest naming them --------------------------------------------
@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.build_request(None, [1]), "model"),
        (lambda c: c.build_request("m", [1], request_id=123), "request_id"),
        (lambda c: c.build_request("m", [1], deadline_s="5"), "deadline_s"),
        (lambda c: c.build_request("m", [1], generation=["max_new_tokens"]), "output.generation"),
        (lambda c: c.build_request("m", [1], generation="x"), "output.generation"),
        (lambda c: c.build_request("m", text=123), "text"),
        (lambda c: c.build_request("m", text=b"Hello"), "text"),
        (lambda c: c.build_request("m", [1], top_k=2.5), "output.top_k"),
        (lambda c: c.build_request("m", 5), "input_ids"),
        (lambda c: c.status(""), "request_id"),
        (lambda c: c.result(""), "request_id"),
        (lambda c: c.status(5), "request_id"),
        (lambda c: c.result(5), "request_id"),
        (lambda c: c.cancel(5), "request_id"),
        (lambda c: c.stream(5), "request_id"),
        (lambda c: c.wait(["a", 5]), "request_ids[1]"),
        (lambda c: c.wait("abc"), "request_ids"),
        (lambda c: c.submit_bulk("m", [[1]], chunk_size=2.5), "chunk_size"),
        (lambda c: c.wait(["a"], timeout_s=math.nan), "timeout_s"),
        (lambda c: c.wait(["a"], timeout_s="5"), "timeout_s"),
        (lambda c: c.wait(["a"], poll_s=0), "poll_s"),
        (lambda c: c.result("a", wait=True, timeout_s=-1), "timeout_s"),
        (lambda c: c.stream("a", timeout_s=math.nan), "timeout_s"),
    ],
)
def test_a_wrong_argument_is_an_invalid_request_naming_it(client: FleetClient, call: Any, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        call(client)
    assert info.value.field == field


def test_a_stream_without_limit_blocks_a_whole_read_and_never_times_out() -> None:
    """stream(timeout_s=inf) raised OverflowError: round(inf) in block_for_ms."""
    cursor = StreamCursor("r", now_s=0.0, timeout_s=math.inf, block_ms=1000)
    assert cursor.block_for_ms(1e9) == 1000 and not cursor.timed_out(1e12)
    assert StreamCursor("r", now_s=0.0, timeout_s=0.5).block_for_ms(0.2) == 300
    with pytest.raises(ValueError, match="timeout_s"):
        StreamCursor("r", now_s=0.0, timeout_s=math.nan)
