"""protocol.redis_conn without a server: URL parsing, Celery options, masking and error texts."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol.errors import ConfigError
from protocol.redis_conn import celery_redis_config, describe_redis_error, mask_url, parse_target, redact
from protocol.settings import FleetSettings, RedisSettings, load_settings

SECRET = "S3cret-pass"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        (f"redis://fleet:{SECRET}@h:6379/0", "redis://fleet:***@h:6379/0"),
        (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://fleet:p%40ss%3Aw@h/0", "redis://fleet:***@h/0"),
        (f"rediss://u:{SECRET}@h:1/0?ssl_ca_certs=/ca.pem", "rediss://u:***@h:1/0?ssl_ca_certs=/ca.pem"),
        (f"redis://h:1/0?password={SECRET}&db=2", "redis://h:1/0?password=***&db=2"),
        (f"sentinel://:{SECRET}@a:1/0;sentinel://b:2", "sentinel://:***@a:1/0;sentinel://b:2"),
        ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
        (f"unix://:{SECRET}@/run/redis.sock", "unix://:***@/run/redis.sock"),
        (f"redis://u:{SECRET}@h:notaport/0", "redis://u:***@h:notaport/0"),
        ("not a url", "not a url"),
    ],
)
def test_mask_url_hides_the_password_and_keeps_the_rest(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_redact_removes_raw_and_quoted_forms() -> None:
    assert redact("auth p@ss:w failed; url had p%40ss%3Aw", "p@ss:w") == "auth *** failed; url had ***"
    assert redact("nothing here", None, "") == "nothing here"


def _settings(url: str, **redis_section: Any) -> FleetSettings:
    return FleetSettings(redis_url=url, redis=RedisSettings(**redis_section))


def test_plain_url_goes_to_celery_unchanged() -> None:
    conf = celery_redis_config(_settings(f"redis://fleet:{SECRET}@h:6379/3"))
    assert conf == {"broker_url": f"redis://fleet:{SECRET}@h:6379/3", "result_backend": f"redis://fleet:{SECRET}@h:6379/3"}
    target = parse_target(_settings(f"redis://fleet:{SECRET}@h:6379/3"))
    assert (target.username, target.password, target.tls) == ("fleet", SECRET, {})
    assert SECRET not in repr(target)


def test_tls_options_merge_settings_files_and_url_query_url_wins() -> None:
    settings = _settings(
        "rediss://h:6380/0?ssl_ca_certs=/url/ca.pem&ssl_check_hostname=false",
        tls_ca_file="/cfg/ca.pem", tls_cert_file="/cfg/client.pem", tls_key_file="/cfg/client.key",
    )
    target = parse_target(settings)
    assert target.url == "rediss://h:6380/0"
    assert target.tls == {
        "ssl_ca_certs": "/url/ca.pem",
        "ssl_certfile": "/cfg/client.pem",
        "ssl_keyfile": "/cfg/client.key",
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_check_hostname": False,
    }
    conf = celery_redis_config(settings)
    assert conf["broker_use_ssl"] == conf["redis_backend_use_ssl"] == target.tls
    # the URLs carry every option too: kombu lets a URL's ssl_* query replace broker_use_ssl whole
    assert conf["broker_url"] == conf["result_backend"]
    for part in ("ssl_ca_certs=/url/ca.pem", "ssl_certfile=/cfg/client.pem", "ssl_keyfile=/cfg/client.key",
                 "ssl_cert_reqs=required", "ssl_check_hostname=false"):
        assert part in conf["broker_url"]


def test_rediss_verifies_the_server_unless_the_url_says_otherwise() -> None:
    assert parse_target(_settings("rediss://h/0")).tls == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert parse_target(_settings("rediss://h/0?ssl_cert_reqs=CERT_NONE")).tls["ssl_cert_reqs"] == ssl.CERT_NONE
    with pytest.raises(ValueError, match="ssl_cert_reqs must be required, optional or none"):
        parse_target(_settings(f"rediss://u:{SECRET}@h/0?ssl_cert_reqs=maybe"))


def test_sentinel_url_lists_the_nodes_and_names_the_master() -> None:
    settings = _settings(f"sentinel://fleet:{SECRET}@s1:26379/2;sentinel://s2;sentinel://s3:26381",
                         sentinel_master="mymaster")
    target = parse_target(settings)
    assert target.sentinels == (("s1", 26379), ("s2", 26379), ("s3", 26381))
    assert (target.sentinel_master, target.username, target.password, target.db) == ("mymaster", "fleet", SECRET, 2)
    conf = celery_redis_config(settings)
    assert conf["broker_url"] == settings.redis_url
    assert conf["broker_transport_options"] == conf["result_backend_transport_options"] == {"master_name": "mymaster"}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"redis_url": "sentinel://s1:26379"}, "set redis.sentinel_master"),
        ({"redis_url": "redis://h/0", "redis": {"tls_ca_file": "/ca.pem"}}, "redis.tls_ca_file is set but redis_url"),
        ({"redis_url": f"rediz://u:{SECRET}@h/0"}, "redis_url"),
    ],
)
def test_bad_redis_settings_name_the_setting_and_never_echo_the_url(
    overrides: dict[str, Any], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEET_REDIS_URL", raising=False)
    config = tmp_path / "fleet.yaml"
    config.write_text("models: {}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config, **overrides)
    assert says in str(info.value)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value.__cause__)


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (redis.AuthenticationError("invalid username-password pair or user is disabled."),
         "refused the credentials of user 'fleet'"),
        (redis.ConnectionError("Error 111 connecting to h:6379. Connection refused."), "unreachable"),
        (redis.ConnectionError("Error 1 connecting to h:6379. [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify "
                               "failed"), "TLS to Redis at"),
        (redis.ConnectionError(f"weird library text with redis://fleet:{SECRET}@h:6379/0 in it"), "unreachable"),
    ],
)
def test_describe_redis_error_names_the_problem_without_the_password(exc: Exception, says: str) -> None:
    text = describe_redis_error(exc, _settings(f"redis://fleet:{SECRET}@h:6379/0"))
    assert says in text and "redis://fleet:***@h:6379/0" in text and SECRET not in text
