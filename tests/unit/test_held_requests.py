"""workers.held_requests and protocol.request_marker: what a worker writes back for the requests it holds is
what the producer and Celery wrote, and reads as running (pure, no Redis)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from producer.results import RequestStatus, status_from
from protocol.keys import REQUEST_KEY, RESULT_KEY
from protocol.messages import InferenceRequest, OutputSpec
from protocol.request_marker import request_fingerprint, request_marker
from workers.held_requests import HeldRequest, HeldRequests, restore_call, started_meta

REQUESTS = [
    InferenceRequest(model="demo-lm", input_ids=[5, 6, 7], request_id="r1", submitted_at_unix_s=1733000000.125,
                     output=OutputSpec(kind="generate", generation={"max_new_tokens": 4000, "ignore_eos": True})),
    InferenceRequest(model="demo-lm", input_ids=[5], request_id="r2", output=OutputSpec(kind="next_token", top_k=3)),
    InferenceRequest(model="demo-encoder", input_ids=list(range(3, 40)), truncated=True, deadline_unix_s=9e9,
                     output=OutputSpec(kind="embedding", normalize=True)),
    InferenceRequest(model="demo-lm", input_ids=[9, 9], output=OutputSpec(generation={"seed": 3})),
]  # fmt: skip


@pytest.mark.parametrize("request_", REQUESTS)
def test_the_marker_a_worker_writes_back_is_the_producer_s_byte_for_byte(request_: InferenceRequest) -> None:
    # the worker decodes the producer's JSON payload: the marker it builds from it is the one the producer wrote
    sent = InferenceRequest.model_validate_json(request_.model_dump_json(exclude_none=True))
    assert request_fingerprint(sent) == request_fingerprint(request_)
    assert request_marker(sent) == request_marker(request_, request_fingerprint(request_))


def _celery_started(request_id: str, pid: int, hostname: str) -> dict[str, Any]:
    """The STARTED meta Celery's own Redis backend writes (``update_state``, ``track_started``: for a task
    request without children)."""
    backend: Any = Celery("t", backend="redis://127.0.0.1:1/0").backend
    meta = backend._get_result_meta(result={"pid": pid, "hostname": hostname}, state="STARTED", traceback=None,
                                    request=SimpleNamespace(children=[]))  # fmt: skip
    meta["task_id"] = request_id
    return dict(json.loads(backend.encode(meta)))


def test_the_started_state_written_back_is_celery_s_and_reads_as_running() -> None:
    raw = started_meta("r1", pid=4321, hostname="w1-demo-lm@test")
    assert json.loads(raw) == _celery_started("r1", 4321, "w1-demo-lm@test")
    meta = Celery("t", backend="redis://127.0.0.1:1/0").backend.decode_result(raw)
    assert status_from(meta, cancel_marked=False, known=True) is RequestStatus.RUNNING


@pytest.mark.parametrize(
    ("meta", "cancel_marked", "known", "status"),
    [
        (None, False, False, RequestStatus.NOT_FOUND),  # what a flush leaves of a running request
        (None, False, True, RequestStatus.QUEUED),  # its marker written back (a one-step request, no STARTED)
        ({"status": "STARTED"}, False, True, RequestStatus.RUNNING),  # both written back
        # a cancel asked of its worker (the mark says held: not for good): still running
        ({"status": "STARTED"}, False, True, RequestStatus.RUNNING),
        # a cancel for good (written before any take): the worker that stored STARTED drops it unrun
        ({"status": "STARTED"}, True, True, RequestStatus.CANCELLED),
        ({"status": "SUCCESS", "result": {}}, False, True, RequestStatus.SUCCEEDED),  # kept: never overwritten
    ],
)
def test_what_each_key_written_back_makes_the_status(
    meta: dict[str, Any] | None, cancel_marked: bool, known: bool, status: RequestStatus
) -> None:
    assert status_from(meta, cancel_marked=cancel_marked, known=known) is status


def test_one_script_run_carries_every_held_request_s_keys_and_values() -> None:
    started = HeldRequest("a", REQUESTS[0], "w1@test")
    one_step = HeldRequest("b", REQUESTS[1], None)
    keys, args = restore_call([started, one_step], 600, 77)
    assert keys == [REQUEST_KEY.format(id="a"), RESULT_KEY.format(id="a"),
                    REQUEST_KEY.format(id="b"), RESULT_KEY.format(id="b")]  # fmt: skip
    assert args == [600, request_marker(REQUESTS[0]), started_meta("a", pid=77, hostname="w1@test"),
                    request_marker(REQUESTS[1]), ""]  # fmt: skip  # '' : no STARTED was stored, none is written


def test_a_held_request_s_values_are_built_once() -> None:
    held = HeldRequest("a", REQUESTS[0], "w1@test")
    first = held.values(77)
    assert held.values(77) is first


class _NoRedis:
    """Stands in for the client: registering the script is all the registry asks of it before a beat."""

    def register_script(self, script: str) -> object:
        return self


def test_requests_are_held_until_released() -> None:
    held = HeldRequests(_NoRedis(), ttl_s=600)  # type: ignore[arg-type]
    held.hold("a", REQUESTS[0], started_by="w1@test")
    held.hold("b", REQUESTS[1], started_by=None)
    held.release("a")
    held.release("never-held")  # a task that failed before it was held releases too
    assert [(h.request_id, h.started_by) for h in held.held()] == [("b", None)]
    held.release("b")
    assert held.held() == []
    held.restore()  # nothing held: no round trip (the stand-in would fail one)
