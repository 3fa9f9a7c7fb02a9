"""Every Redis connection of the fleet, built from one place: the ``redis_url`` setting (+ ``redis.*``).

URL forms (the password, when any, travels in the URL: set it with ``FLEET_REDIS_URL``, never in a
config file)::

    redis://[USER:PASSWORD@]HOST:PORT/DB                   plain TCP; ACL user or requirepass
    rediss://[USER:PASSWORD@]HOST:PORT/DB[?ssl_ca_certs=…&ssl_certfile=…&ssl_keyfile=…&ssl_cert_reqs=required]
    unix:///PATH/redis.sock?db=0
    sentinel://[USER:PASSWORD@]HOST:PORT/DB;sentinel://HOST:PORT;…   Sentinel nodes; redis.sentinel_master
                                                                     names the master; USER:PASSWORD is the
                                                                     master's (the sentinels have none)

TLS (``rediss://``) options come from the URL's ``ssl_*`` query or from ``redis.tls_ca_file``,
``redis.tls_cert_file``, ``redis.tls_key_file`` (paths only); the URL's query wins key by key, and
the server's certificate is verified (``ssl_cert_reqs=required``) unless the URL says otherwise.

* :func:`sync_client` / :func:`async_client`: the fleet's own redis-py clients (producer, admission,
  worker runtime and stream publisher, gateway); with Sentinel they follow the master across a
  failover (each new connection asks the sentinels where the master is). Their pools disconnect the
  idle connections Redis closed as soon as one is found closed (:mod:`protocol.redis_pools`), so a
  Redis restart does not leave the pool's idle sockets half-closed until each is reused.
* :func:`celery_redis_config`: broker and result-backend URLs and options for Celery
  (``broker_use_ssl``, ``redis_backend_use_ssl``, Sentinel's ``master_name``), and through
  :mod:`producer.flower_broker` for Flower.
* :func:`mask_url` and :func:`redact`: what every message that shows a URL or a library's error
  text goes through, so a password never reaches a log, a result or an exception.
"""

from __future__ import annotations

import re
import ssl
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from kombu import Connection  # type: ignore[attr-defined]

from protocol.redis_pools import AsyncSweepingPool, AsyncSweepingSentinelPool, SweepingPool, SweepingSentinelPool

if TYPE_CHECKING:
    from protocol.settings import FleetSettings

__all__ = [
    "LISTEN_WAIT_S",
    "SCHEMES",
    "TLS_QUERY_KEYS",
    "MaskedConnection",
    "RedisTarget",
    "async_client",
    "await_subscription",
    "celery_redis_config",
    "describe_redis_error",
    "mask_url",
    "parse_target",
    "passwords_in",
    "redact",
    "sync_client",
]

SCHEMES = ("redis", "rediss", "unix", "sentinel")
"""URL schemes ``redis_url`` may use."""
TLS_QUERY_KEYS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
"""``rediss://`` query parameters read as TLS options (the names redis-py, kombu and Celery share)."""
MASK = "***"
_SECRET_QUERY_KEYS = ("password", "ssl_password")
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
DEFAULT_SENTINEL_PORT = 26379
LISTEN_WAIT_S = 0.1
"""How long a listening thread's pub/sub read waits (seconds) before it looks at its stop flag again: a
warm shutdown waits up to this for each listener it stops (a wait of 1 s cost every stop about 1 s)."""


@dataclass(frozen=True)
class RedisTarget:
    """Where and how to connect, parsed from the settings (see the module docstring).

    ``url`` is the URL without its TLS query (those options are in ``tls``); for Sentinel it is
    the whole ``sentinel://…;sentinel://…`` list. ``tls`` is empty unless the scheme is ``rediss``.
    """

    scheme: str
    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    tls: dict[str, Any] = field(default_factory=dict)

    @property
    def is_sentinel(self) -> bool:
        return self.scheme == "sentinel"

    def __repr__(self) -> str:  # never the password, wherever a target gets printed
        return (
            f"RedisTarget({mask_url(self.url)!r}, sentinels={self.sentinels!r}, "
            f"sentinel_master={self.sentinel_master!r}, username={self.username!r}, db={self.db}, tls={self.tls!r})"
        )


def parse_target(settings: FleetSettings) -> RedisTarget:
    """The :class:`RedisTarget` of ``settings.redis_url`` and ``settings.redis``.

    Raises:
        ValueError: an unknown scheme, a Sentinel URL without ``redis.sentinel_master``, or an invalid
            ``ssl_cert_reqs`` (the message shows the URL masked).
    """
    url = settings.redis_url
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(f"redis_url {mask_url(url)} must start with one of {', '.join(s + '://' for s in SCHEMES)}")
    if scheme == "sentinel":
        return _sentinel_target(url, settings.redis.sentinel_master)
    base, query = _split_tls_query(url)
    tls: dict[str, Any] = {}
    if scheme == "rediss":
        cfg = settings.redis
        files = {"ssl_ca_certs": cfg.tls_ca_file, "ssl_certfile": cfg.tls_cert_file, "ssl_keyfile": cfg.tls_key_file}
        tls = {key: str(path) for key, path in files.items() if path is not None}
        tls["ssl_cert_reqs"] = "required"
        tls.update(query)
        tls["ssl_cert_reqs"] = _cert_reqs(str(tls["ssl_cert_reqs"]), url)
        if "ssl_check_hostname" in tls:
            tls["ssl_check_hostname"] = str(tls["ssl_check_hostname"]).lower() not in ("false", "0", "no")
    parts = urlsplit(base)
    return RedisTarget(
        scheme=scheme,
        url=base,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        tls=tls,
    )


def _sentinel_target(url: str, master: str | None) -> RedisTarget:
    if not master:
        raise ValueError(
            f"redis_url {mask_url(url)} is a sentinel:// URL: set redis.sentinel_master "
            "(FLEET_REDIS__SENTINEL_MASTER) to the name the sentinels monitor"
        )
    nodes: list[tuple[str, int]] = []
    first = None
    for chunk in url.split(";"):
        parts = urlsplit(chunk.strip())
        if parts.scheme.lower() != "sentinel" or not parts.hostname:
            raise ValueError(f"redis_url {mask_url(url)}: every ';'-separated part must be sentinel://HOST:PORT")
        nodes.append((parts.hostname, parts.port or DEFAULT_SENTINEL_PORT))
        first = first or parts
    assert first is not None
    db = first.path.strip("/")
    return RedisTarget(
        scheme="sentinel",
        url=url,
        sentinels=tuple(nodes),
        sentinel_master=master,
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
        db=int(db) if db.isdigit() else 0,
    )


def _cert_reqs(value: str, url: str) -> ssl.VerifyMode:
    try:
        return _CERT_REQS[value.lower().removeprefix("cert_")]
    except KeyError:
        raise ValueError(
            f"redis_url {mask_url(url)}: ssl_cert_reqs must be required, optional or none, not {value!r}"
        ) from None


def _split_tls_query(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without its ``ssl_*`` query parameters, and those parameters."""
    base, _, query = url.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    tls = {k: v for k, v in pairs if k in TLS_QUERY_KEYS}
    if not tls:
        return url, {}
    rest = [(k, v) for k, v in pairs if k not in TLS_QUERY_KEYS]
    return base + ("?" + urlencode(rest) if rest else ""), tls


# -- clients ---------------------------------------------------------------------------------------
def sync_client(settings: FleetSettings, **kwargs: Any) -> redis.Redis[bytes]:
    """A redis-py client for ``settings`` (``kwargs``: client options such as ``socket_timeout``).

    With Sentinel it is a ``master_for`` client: every new connection asks the sentinels for the
    current master, so a command after a failover reaches the promoted replica.
    """
    target = parse_target(settings)
    if target.is_sentinel:
        manager = redis.sentinel.Sentinel(list(target.sentinels), **_sentinel_node_options(kwargs))
        return manager.master_for(
            str(target.sentinel_master), redis_class=redis.Redis, connection_pool_class=SweepingSentinelPool,
            **_master_options(target), **kwargs,
        )
    client: redis.Redis[bytes] = redis.Redis.from_pool(  # type: ignore[attr-defined]  # types-redis predates from_pool
        SweepingPool.from_url(target.url, **target.tls, **kwargs)
    )
    return client


def async_client(settings: FleetSettings, **kwargs: Any) -> redis.asyncio.Redis[bytes]:
    """The asyncio twin of :func:`sync_client` (the gateway waits on results and streams with it)."""
    target = parse_target(settings)
    if target.is_sentinel:
        manager = redis.asyncio.sentinel.Sentinel(list(target.sentinels), **_sentinel_node_options(kwargs))
        return manager.master_for(
            str(target.sentinel_master), redis_class=redis.asyncio.Redis,
            connection_pool_class=AsyncSweepingSentinelPool, **_master_options(target), **kwargs,
        )
    client: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_pool(  # type: ignore[attr-defined]
        AsyncSweepingPool.from_url(target.url, **target.tls, **kwargs)
    )
    return client


def _master_options(target: RedisTarget) -> dict[str, Any]:
    options: dict[str, Any] = {"db": target.db}
    if target.username:
        options["username"] = target.username
    if target.password:
        options["password"] = target.password
    return options


def _sentinel_node_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Options of the connections to the sentinels themselves: the caller's socket timeouts."""
    socket = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    socket.setdefault("socket_connect_timeout", 1.0)
    socket.setdefault("socket_timeout", 2.0)
    return {"sentinel_kwargs": socket}


# -- Celery ----------------------------------------------------------------------------------------
def celery_redis_config(settings: FleetSettings) -> dict[str, Any]:
    """Celery settings for the broker and the result backend on ``settings``' Redis.

    ``broker_use_ssl`` and ``redis_backend_use_ssl`` carry the TLS options (rediss:// only), and
    ``broker_url`` / ``result_backend`` carry them too, as their ``ssl_*`` query: kombu lets a URL's
    query replace ``broker_use_ssl`` whole, and parses URLs on its own in places (Celery's ``conf``
    dump for Flower), where a ``rediss://`` URL without them reads as "unverified". Sentinel adds
    ``master_name`` to both transport-option dicts (merge them into the caller's own).
    """
    target = parse_target(settings)
    url = target.url
    if target.tls:
        query = {k: _query_value(v) for k, v in target.tls.items()}
        url += ("&" if "?" in url else "?") + urlencode(query, safe="/")
    conf: dict[str, Any] = {"broker_url": url, "result_backend": url}
    if target.tls:
        conf["broker_use_ssl"] = dict(target.tls)
        conf["redis_backend_use_ssl"] = dict(target.tls)
    if target.is_sentinel:
        conf["broker_transport_options"] = {"master_name": target.sentinel_master}
        conf["result_backend_transport_options"] = {"master_name": target.sentinel_master}
    return conf


def _query_value(value: Any) -> str:
    if isinstance(value, ssl.VerifyMode):
        return {v: k for k, v in _CERT_REQS.items()}[value]
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- secrets out of messages -----------------------------------------------------------------------
def mask_url(url: str) -> str:
    """``url`` with its password (and any ``password=`` query value) replaced by ``***``.

    Each ``;``-separated part of a Sentinel list is masked; the user name stays (it helps to tell
    which ACL user was refused). A text that is not a URL comes back unchanged.
    """
    return ";".join(_mask_one(part) for part in url.split(";"))


def _mask_one(url: str) -> str:
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return re.sub(r"(://[^:/@]*:)[^@/]*@", rf"\1{MASK}@", url)
    # rebuilt by replacing substrings: urlunsplit would turn unix:///path into unix:/path
    base, sep, query = url.partition("?")
    if password is not None and "@" in parts.netloc:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        base = base.replace(parts.netloc, f"{userinfo.partition(':')[0]}:{MASK}@{hostport}", 1)
    if any(key in query for key in _SECRET_QUERY_KEYS):
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if k in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*/")
    return base + sep + query


class MaskedConnection(Connection):
    """kombu's Connection, whose URL as Celery and Flower show it (the worker's banner, "Connected to",
    "Cannot connect to", Flower's "Broker:") goes through :func:`mask_url`: ``***`` for a password only
    when the URL has one, where kombu's own ``as_uri`` writes ``redis://:**@host`` even without one.
    Installed by :func:`broker.make_celery` as the app's connection class."""

    def as_uri(self, include_password: Any = False, mask: Any = "**", getfields: Any = None) -> str:
        full: str = super().as_uri(include_password=True)
        return full if include_password else mask_url(full)


def redact(text: str, *secrets: str | None) -> str:
    """``text`` with every occurrence of each secret (raw and URL-quoted) replaced by ``***``.

    Use on a library's error text before showing it, with the password of the URL in use
    (``parse_target(settings).password``): whatever the library put in its message, the
    password does not get out.
    """
    for secret in secrets:
        if secret:
            for form in {secret, quote(secret, safe="")}:
                text = text.replace(form, MASK)
    return text


def passwords_in(url: str) -> list[str]:
    """The passwords a URL carries (in each ``;``-separated part, and ``password=`` query values)."""
    found = []
    for part in url.split(";"):
        try:
            parts = urlsplit(part)
            if parts.password:
                found += [parts.password, unquote(parts.password)]
            found += [v for k, v in parse_qsl(parts.query) if k in _SECRET_QUERY_KEYS and v]
        except ValueError:
            continue
    return found


def describe_redis_error(exc: BaseException, settings: FleetSettings) -> str:
    """One line that says what went wrong reaching Redis, with the URL masked and no password.

    A refused password (``WRONGPASS``, ``NOAUTH``, ``invalid password``) is named as such, with
    the user it was tried for; TLS failures are named as TLS failures.
    """
    url = mask_url(settings.redis_url)
    text = redact(str(exc), *passwords_in(settings.redis_url))
    lowered = text.lower()
    if isinstance(exc, redis.AuthenticationError) or any(
        word in lowered for word in ("wrongpass", "noauth", "invalid password", "invalid username-password")
    ):
        user = _user_of(settings.redis_url)
        return (
            f"Redis at {url} refused the credentials of user {user!r}: {text} "
            "(check the user and password in redis_url / FLEET_REDIS_URL)"
        )
    if isinstance(exc, ssl.SSLError) or "ssl" in lowered or "certificate" in lowered:
        return f"TLS to Redis at {url} failed: {text} (check redis.tls_* / the ssl_* options of redis_url)"
    return f"Redis at {url} unreachable: {text}"


def _user_of(url: str) -> str:
    try:
        parts = urlsplit(url.split(";", 1)[0])
        return unquote(parts.username) if parts.username else "default"
    except ValueError:
        return "default"


def await_subscription(pubsub: Any, channel: str | bytes, until_monotonic_s: float) -> bool:
    """Read ``pubsub`` (made with ``ignore_subscribe_messages=False``) until Redis confirms the
    subscription to ``channel``; False at ``until_monotonic_s``.

    Call it between ``SUBSCRIBE`` and a read of what the channel announces (a result key, a state):
    the read goes on another connection, which Redis may serve first, so without the confirmation
    a change made between the read and the subscription is neither read nor heard. Nothing for
    ``channel`` can come before its confirmation (one connection, in order); what is read here is the
    previous subscriptions' confirmations and late messages of their channels."""
    wanted = channel.encode() if isinstance(channel, str) else channel
    while True:
        now = time.monotonic()
        if now >= until_monotonic_s:
            return False
        message = pubsub.get_message(timeout=until_monotonic_s - now)
        if message and message.get("type") == "subscribe" and message.get("channel") == wanted:
            return True
