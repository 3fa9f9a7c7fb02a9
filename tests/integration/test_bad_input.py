"""Bad input gets a clear error naming the field and the limit; nothing is queued; no worker dies."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from protocol.errors import (
    DecodeError,
    EmptyInput,
    FleetError,
    InputTooLong,
    InvalidRequest,
    TokenOutOfRange,
    UnknownModel,
)
from protocol.keys import WORKER_KEY_PREFIX
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import wait_until

CLIENT_CASES = [
    ({"input_ids": []}, EmptyInput, "input_ids", "at least 1 token"),
    ({"input_ids": [1, 2, 3000]}, TokenOutOfRange, "input_ids[2]", "[0, 512)"),
    ({"input_ids": [1, -1]}, TokenOutOfRange, "input_ids[1]", "[0, 512)"),
    ({"input_ids": [7] * 129}, InputTooLong, "input_ids", "max_input_tokens=128"),
    ({"input_ids": [1, "x"]}, InvalidRequest, "input_ids[1]", "not an integer"),
    ({"input_ids": [1, 2.5]}, InvalidRequest, "input_ids[1]", "not an integer"),
    ({"input_ids": [1], "top_k": 1000}, InvalidRequest, "output.top_k", "max_top_k=64"),
    ({"input_ids": [1], "kind": "embedding"}, InvalidRequest, "output.kind", "next_token"),
    ({"input_ids": [1], "top_k": 3, "generation": {}}, InvalidRequest, "output.top_k", "leave top_k out"),
    # an ID the gateway could not serve (GET /v1/requests/{id}) is refused as the gateway refuses it
    ({"input_ids": [1], "request_id": "user 7/turn 2"}, InvalidRequest, "request_id", "1 to 128 letters"),
    ({"input_ids": [1], "request_id": "x" * 129}, InvalidRequest, "request_id", "1 to 128 letters"),
]


@pytest.mark.parametrize(("kwargs", "error", "field", "says"), CLIENT_CASES)
def test_client_refuses_before_queueing(fleet: Fleet, kwargs: dict[str, object], error: type[FleetError],
                                        field: str, says: str) -> None:
    client = fleet.client(fleet.config())
    with pytest.raises(error) as info:
        client.submit("demo-lm", **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert says in str(info.value)
    assert redis.Redis.from_url(fleet.redis_url).llen("fleet.demo-lm") == 0


def test_a_generation_that_cannot_fit_is_refused_by_the_client(fleet: Fleet) -> None:
    """prompt + max_new_tokens beyond the worker's KV budget (or the model's positions) was queued, then failed in
    the worker; the default max_new_tokens is cut to what fits, and a prompt that leaves no room is refused."""
    client = fleet.client(fleet.config(models={"demo-lm": {"batching": {"max_kv_tokens": 64}}}))
    for ids, generation, room in (([1] * 60, {"max_new_tokens": 10}, 4), ([1] * 64, {}, 0), ([1] * 100, {}, 0)):
        with pytest.raises(InvalidRequest) as info:
            client.submit("demo-lm", ids, generation=generation)
        # a prompt that leaves no room is what must change: named, with the longest that leaves room for one
        named = ("output.generation.max_new_tokens", room) if room else ("input_ids", 63)
        assert (info.value.field, info.value.limit) == named, info.value
        assert "max_kv_tokens=64" in str(info.value) and ("no room" in str(info.value)) == (room == 0)
    assert redis.Redis.from_url(fleet.redis_url).llen("fleet.demo-lm") == 0
    assert client.submit("demo-lm", [1] * 60, generation={})  # the default is cut to the 4 that fit


def test_unknown_model_is_refused_by_the_client(fleet: Fleet) -> None:
    client = fleet.client(fleet.config())
    with pytest.raises(UnknownModel, match="configured models: demo-encoder, demo-llama, demo-lm"):
        client.submit("nope", [1, 2])


WORKER_CASES = [
    ([{"model": "demo-lm", "input_ids": []}], "EmptyInput", "input_ids"),
    ([{"model": "demo-lm", "input_ids": [1, 99999]}], "TokenOutOfRange", "input_ids[1]"),
    ([{"model": "demo-lm", "input_ids": list(range(3, 140))}], "InputTooLong", "input_ids"),
    ([{"model": "demo-lm", "input_ids": [1, "two"]}], "DecodeError", "input_ids.1"),
    ([{"model": "demo-lm", "input_ids": [1, True]}], "DecodeError", "input_ids.1"),
    ([{"model": "demo-lm"}], "DecodeError", "input_ids"),
    ([{"model": "demo-lm", "input_ids": [1], "surprise": 1}], "DecodeError", "surprise"),
    (["not an object"], "DecodeError", "request"),
    ([{"model": "demo-encoder", "input_ids": [1, 2]}], "UnknownModel", "model"),
    ([{"model": "demo-lm", "input_ids": [1], "output": {"top_k": 0}}], "DecodeError", "output.top_k"),
    ([], "DecodeError", "args"),
]


def test_worker_fails_bad_messages_and_keeps_serving(fleet: Fleet) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    client = fleet.client(cfg)
    for args, type_name, field in WORKER_CASES:
        res = plain.send_task("fleet.infer", args=args, queue="fleet.demo-lm")
        with pytest.raises(Exception) as info:
            res.get(timeout=30)
        assert res.state == "FAILURE"
        assert type(info.value).__name__ == type_name, (args, info.value)
        message, got_field, _limit = info.value.args
        assert got_field == field, (args, info.value.args)
        assert message
        # the client maps the same stored failure to the shared error tree
        with pytest.raises(FleetError) as mapped:
            client.result(res.id, wait=True, timeout_s=5)
        assert type(mapped.value).__name__ == type_name and mapped.value.field == field
    # a message that is not even a Celery message: garbage pushed straight into the queue list
    r = redis.Redis.from_url(fleet.redis_url)
    r.lpush("fleet.demo-lm", b"this is not json")
    r.lpush("fleet.demo-lm", json.dumps({"body": "bm9wZQ==", "headers": {}, "properties": {}}))
    # a pickle message is refused (JSON only) rather than executed
    pickled = plain.send_task("fleet.infer", args=[{"model": "demo-lm", "input_ids": [1]}],
                              queue="fleet.demo-lm", serializer="pickle", task_id=uuid.uuid4().hex)
    good = client.submit("demo-lm", [5, 6, 7])
    result = client.result(good, wait=True, timeout_s=30)
    assert result is not None and result.top_k
    assert pickled.state == "FAILURE"  # refused (JSON only) and never executed
    assert r.llen("fleet:dead-letter") == 3  # the two non-messages and the pickle message were kept
    assert worker.proc is not None and worker.proc.poll() is None
    assert "ContentDisallowed" in worker.log_tail(200000) or "disallowed" in worker.log_tail(200000).lower()
    plain.close()


def test_decode_error_is_an_invalid_request() -> None:
    assert issubclass(DecodeError, InvalidRequest)


def test_a_limit_above_the_models_positions_refuses_the_excess_and_keeps_the_worker_ready(fleet: Fleet) -> None:
    """``limits.max_input_tokens`` set above the model card's ``max_positions`` (512 for demo-lm): the client and
    the worker checked the setting alone, so 600 tokens reached ONNX Runtime, failed in its position ``Gather``
    with no field named, and counted as a failed engine run: ``worker.not_ready_after_failed_runs`` of them took
    a worker out of readiness. Now both refuse past the positions, naming ``input_ids`` and 512."""
    cfg = fleet.config(models={"demo-lm": {"limits": {"max_input_tokens": 2000}}},
                       worker={"not_ready_after_failed_runs": 2})  # fmt: skip
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    with pytest.raises(InputTooLong) as refused:
        client.submit("demo-lm", [5] * 600)
    assert (refused.value.field, refused.value.limit) == ("input_ids", 512), refused.value
    assert "max_positions" in str(refused.value) and "max_input_tokens=2000" in str(refused.value)

    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)  # the worker's own check, past the client's
    for _ in range(3):
        res = plain.send_task("fleet.infer", args=[{"model": "demo-lm", "input_ids": [5] * 600}],
                              queue="fleet.demo-lm")  # fmt: skip
        with pytest.raises(Exception) as failed:
            res.get(timeout=60)
        assert type(failed.value).__name__ == "InputTooLong", failed.value
        assert failed.value.args[1:] == ("input_ids", 512), failed.value.args
    refused_by = time.time()
    r = redis.Redis.from_url(fleet.redis_url)

    def beat() -> dict[str, Any]:
        return dict(json.loads(r.get(WORKER_KEY_PREFIX + worker.hostname) or b"{}"))

    wait_until(lambda: beat().get("heartbeat_unix_s", 0) > refused_by, 60, "a beat after the refusals")
    assert (beat()["failed_runs"], beat()["ready"]) == (0, True), beat()  # refusals are no failed runs
    assert client.result(client.submit("demo-lm", [5] * 512), wait=True, timeout_s=60) is not None  # the most
    assert "above the model's max_positions=512" in worker.log_tail(20_000)
