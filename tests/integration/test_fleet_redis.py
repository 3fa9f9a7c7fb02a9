"""`fleet redis` never reports a server it did not start."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys

import pytest
import redis

import tools.redis_server
from tests.integration.conftest import picks_first
from tools.redis_server import EmbeddedRedis, PortInUse


def test_taken_port_is_refused_naming_the_port(redis_server: EmbeddedRedis) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "redis", "--port", str(redis_server.port)],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 1
    assert f"port {redis_server.port}" in proc.stderr and "already in use" in proc.stderr
    assert "listening" not in proc.stdout


def test_embedded_server_refuses_a_taken_port_and_answers_only_for_itself(redis_server: EmbeddedRedis) -> None:
    with pytest.raises(PortInUse):
        EmbeddedRedis(redis_server.port).start()
    with EmbeddedRedis() as own:
        assert own.proc is not None
        info = redis.Redis(port=own.port).info("server")
        assert int(info["process_id"]) == own.proc.pid


@pytest.mark.parametrize("seen_taken", [True, False], ids=["taken-before-the-check", "taken-after-the-check"])
def test_a_picked_port_taken_before_the_server_binds_it_is_replaced_by_another_pick(
    taken_port: int, seen_taken: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free port is free only until another process binds it (another test's server, a client's outgoing
    connection): a port the server picked itself is picked again; one the caller named is refused."""
    monkeypatch.setattr(tools.redis_server, "free_port", picks_first(taken_port))
    if not seen_taken:  # taken between port_is_free and redis-server's own bind: redis-server exits
        monkeypatch.setattr(tools.redis_server, "port_is_free", lambda port: True)
    with EmbeddedRedis() as server:
        assert server.port != taken_port
        assert server.proc is not None and int(server.client().info("server")["process_id"]) == server.proc.pid
        server.kill()
        server.start()  # a restart keeps the port its clients know
        assert server.client().ping()
    with pytest.raises(PortInUse):
        EmbeddedRedis(taken_port).start()


def test_port_zero_picks_a_free_port_and_says_which_and_ctrl_c_stops_it() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "redis", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as a script's `cmd &` starts it: SIGINT inherited ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on port" in line and "FLEET_REDIS_URL=redis://127.0.0.1:" in line
        port = int(line.split("listening on port ")[1].split()[0])
        assert redis.Redis(port=port).ping()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=port, socket_connect_timeout=1).ping()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(15)


def test_stopping_a_server_first_lets_a_plain_celery_client_s_garbage_unsubscribe() -> None:
    """A plain Celery client subscribes to each result it sends; when such an ``AsyncResult`` sits in a
    reference cycle, it unsubscribes only when the collector runs. Collected after its server is
    gone, Celery retried the unsubscribe 20 times, 1 s apart, on whatever thread ran the collector
    (a later test's load thread timed out behind it). ``stop()`` collects while the server answers."""
    from celery import Celery

    server = EmbeddedRedis().start()
    plain = Celery(broker=server.url, backend=server.url)
    consumer = plain.backend.result_consumer
    gc.disable()  # the collector runs where stop() puts it, not at some allocation in between
    try:
        for _ in range(3):
            sent = plain.send_task("fleet.infer", args=[{"model": "demo-lm", "input_ids": [1]}], queue="nowhere")
            cycle: dict[str, object] = {"result": sent}
            cycle["self"] = cycle
            del sent, cycle
        assert len(consumer.subscribed_to) == 3
        server.stop()
        assert not consumer.subscribed_to  # unsubscribed while the server still answered: nothing to retry
    finally:
        consumer.subscribed_to.clear()  # on failure: keep the 20 s of retries out of the rest of the run
        consumer._pubsub = None
        gc.enable()
        server.stop()
