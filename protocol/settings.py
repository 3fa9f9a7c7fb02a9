"""Settings: one validated object per process, built once in ``main()`` and passed down.

Sources, highest priority first:

0. the keyword overrides of :func:`load_settings` (``FleetClient.from_settings(**overrides)``, CLI flags);
1. environment variables ``FLEET_*`` with ``__`` for nesting, e.g.
   ``FLEET_REDIS_URL=redis://host:6379/0``, ``FLEET_WORKER__CONCURRENCY=16``,
   ``FLEET_MODELS__DEMO_LM__BATCHING__MAX_WAIT_MS=5`` (model names match case-insensitively,
   with ``-`` and ``_`` treated alike);
2. the YAML file named by ``FLEET_CONFIG`` (default ``configs/fleet.yaml``);
3. the defaults of the fields.

An invalid value raises :class:`protocol.errors.ConfigError` naming the setting and the rule.

This module holds :class:`FleetSettings` (the top-level fields and the rules across sections) and
:func:`load_settings`; the sections, each importable from here too, live beside it:
``settings_model`` (a model: batching, limits, canary, routing), ``settings_engine`` (its ``engine``),
``settings_worker`` (``worker``, ``log``), ``settings_gateway`` (``api``, ``admission``, ``flower``),
``settings_broker`` (``redis``, ``celery``), ``settings_store`` (``store``); ``settings_sources`` reads the
YAML file and words the refusals.
"""

from __future__ import annotations

import contextvars
import difflib
import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from protocol.errors import ConfigError, UnknownModel
from protocol.settings_broker import CelerySettings, RedisSettings
from protocol.settings_engine import GRAPH_CAPTURE_OPTIONS as GRAPH_CAPTURE_OPTIONS
from protocol.settings_engine import PROVIDERS as PROVIDERS
from protocol.settings_engine import EngineSettings
from protocol.settings_env import settings_env_problem
from protocol.settings_gateway import AdmissionSettings, ApiSettings, FlowerSettings
from protocol.settings_model import BatchingSettings, CanarySettings, LimitSettings, ModelSettings, RoutingSettings
from protocol.settings_sources import (
    deep_merge,
    describe,
    first_loc,
    name_env_only_models,
    norm_name,
    read_yaml,
    resolve_model_paths,
)
from protocol.settings_store import StoreSettings
from protocol.settings_worker import LogSettings, WorkerSettings

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DIRECT_QUEUE_INFIX",
    "AdmissionSettings",
    "ApiSettings",
    "BatchingSettings",
    "CanarySettings",
    "CelerySettings",
    "EngineSettings",
    "FleetSettings",
    "FlowerSettings",
    "LimitSettings",
    "LogSettings",
    "ModelSettings",
    "RedisSettings",
    "RoutingSettings",
    "StoreSettings",
    "WorkerSettings",
    "deep_merge",
    "load_settings",
    "no_config_file_read",
    "no_models_configured",
    "shared_queue_of",
]

DEFAULT_CONFIG_PATH = Path("configs/fleet.yaml")
_DATABASE = re.compile(r"[0-9]{1,9}")
"""A Redis database number in a URL: ASCII digits (not ``+1``, ``1_0``, ``１``), what redis-py and Celery both read."""


class FleetSettings(BaseSettings):
    """Everything one process needs; see the module docstring for sources and priorities."""

    model_config = SettingsConfigDict(
        env_prefix="FLEET_",
        env_nested_delimiter="__",
        case_sensitive=False,
        extra="forbid",
        frozen=True,
        hide_input_in_errors=True,  # a rejected redis_url may hold a password: never echo it back
    )

    _config_file: Path | None = PrivateAttr(default=None)
    """The YAML file these settings were read from (set by :func:`load_settings`; None: built-in defaults)."""

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        pattern=r"^(redis|rediss|unix|sentinel)://",
        description="redis://, rediss:// (TLS), unix:// or sentinel://host:port;sentinel://… (protocol.redis_conn).",
    )
    redis: RedisSettings = Field(default_factory=RedisSettings)
    result_ttl_s: int = Field(default=3600, ge=1, le=30 * 86400, description="How long results live (s).")
    visibility_timeout_s: int = Field(
        default=3600,
        ge=1,
        description="Redis broker: an unacked request is redelivered after this long (s). Must exceed the "
        "longest one-step batch wait + inference; a generation's worker renews it at each heartbeat while it runs.",
    )
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    flower: FlowerSettings = Field(default_factory=FlowerSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    celery: CelerySettings = Field(default_factory=CelerySettings)
    log: LogSettings = Field(default_factory=LogSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML file arrives as init kwargs; environment variables must beat it. load_settings' overrides
        # are applied to settings already built from both: then the init kwargs are the only source.
        if _OVERRIDING.get():
            return (init_settings,)
        return (env_settings, init_settings)

    @model_validator(mode="before")
    @classmethod
    def _merge_env_model_names(cls, data: Any) -> Any:
        """Let ``FLEET_MODELS__DEMO_LM__…`` address the YAML model ``demo-lm``.

        pydantic-settings lower-cases env keys, so that variable arrives as a second model
        ``demo_lm``. Keys that differ only by case or ``-``/``_`` are merged under the YAML
        spelling, the env-shaped one (lower case, no ``-``) winning field by field.
        """
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
            return data
        merged: dict[str, Any] = {}
        names: dict[str, str] = {}
        env_shaped = sorted(data["models"], key=lambda k: k == k.lower() and "-" not in k)
        for key in env_shaped:
            value = data["models"][key]
            norm = norm_name(key)
            if norm in names and isinstance(value, dict) and isinstance(merged[names[norm]], dict):
                merged[names[norm]] = deep_merge(merged[names[norm]], value)
            else:
                names[norm] = key
                merged[key] = value
        return {**data, "models": merged}

    @field_validator("redis_url")
    @classmethod
    def _check_redis_ports_and_databases(cls, url: str) -> str:
        """Each host's port (every ``;``-separated part of a sentinel:// list) is a number from 0 to 65535, and
        each part's database (``/DB``, or ``?db=DB``) an integer from 0: refused here, not by the first connection
        (redis-py read ``/abc`` as database 0, Celery raised on it). The message never shows the URL: it may hold
        a password."""
        for part in (p.strip() for p in url.split(";")):
            try:
                parts = urlsplit(part)
                _ = parts.port  # raises on a bad one
            except ValueError:  # not echoed: in redis://USER:PASSWORD/0 (no @HOST), urlsplit's "port" is the password
                raise ValueError("a port must be a number from 0 to 65535 (redis://HOST:PORT/DB)") from None
            path_db = None if parts.scheme.lower() == "unix" else parts.path.removeprefix("/")  # unix://: a socket
            for db in (path_db, *(v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "db")):
                if db is not None and db != "" and not _DATABASE.fullmatch(db):
                    shown = "" if "@" in db or ":" in db else f" {db!r}"  # "@": part of a password with a "/" in it
                    raise ValueError(f"database{shown} is not an integer from 0 to the server's `databases` - 1 "
                                     "(16 by default): redis://HOST:PORT/DB")
        return url

    @model_validator(mode="after")
    def _check_redis(self) -> FleetSettings:
        scheme = self.redis_url.partition("://")[0].lower()
        tls_files = [n for n in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(self.redis, n)]
        if tls_files and scheme != "rediss":
            raise ValueError(f"redis.{tls_files[0]} is set but redis_url is not rediss:// (TLS files need one)")
        if scheme == "sentinel" and not self.redis.sentinel_master:
            raise ValueError("redis_url is sentinel://: set redis.sentinel_master to the name the sentinels monitor")
        return self

    @model_validator(mode="after")
    def _check_store(self) -> FleetSettings:
        served = [name for name, model in self.models.items() if model.store_version]
        if served and self.store.backend == "none":
            raise ValueError(f"models.{served[0]}.store_version is set but store.backend is 'none': configure 'store'")
        return self

    @model_validator(mode="after")
    def _check_models(self) -> FleetSettings:
        for name, model in self.models.items():
            if self.worker.model == name and self.worker.concurrency < model.batching.max_batch_size:
                raise ValueError(
                    f"worker.concurrency ({self.worker.concurrency}) must be >= "
                    f"models.{name}.batching.max_batch_size ({model.batching.max_batch_size}): "
                    "a batch can never exceed the tokens a worker holds"
                )
        return self

    def model_key(self, name: str) -> str:
        """The configured key for ``name`` (case and ``-``/``_`` insensitive).

        Raises:
            UnknownModel: no such model is configured.
        """
        wanted = norm_name(name)
        for key in self.models:
            if norm_name(key) == wanted:
                return key
        known = ", ".join(sorted(self.models)) or "none"
        why = "" if self.models or self._config_file else f" ({no_config_file_read()})"
        raise UnknownModel(f"unknown model {name!r}; configured models: {known}{why}", "model", known)

    @property
    def config_file(self) -> Path | None:
        """The YAML file these settings were read from; None when no file was (built-in defaults only)."""
        return self._config_file

    def model(self, name: str) -> ModelSettings:
        """Settings of model ``name``; raises :class:`UnknownModel` when it is not configured."""
        return self.models[self.model_key(name)]

    def queue_for(self, name: str) -> str:
        """Celery queue that carries requests for model ``name``."""
        key = self.model_key(name)
        return self.models[key].queue or f"fleet.{key}"

    def canary_queue_for(self, name: str) -> str:
        """Celery queue that carries model ``name``'s canary traffic: its queue + ``.canary``."""
        return self.queue_for(name) + ".canary"

    def direct_queue_for(self, name: str, hostname: str) -> str:
        """The queue of one worker (``hostname``, its Celery node name) of model ``name``: its queue +
        ``.w.`` + hostname, where prefix-aware routing sends the requests whose prefix it holds."""
        return self.queue_for(name) + DIRECT_QUEUE_INFIX + hostname


DIRECT_QUEUE_INFIX = ".w."
"""Between a model's queue and a worker's hostname in the name of that worker's own queue."""


def shared_queue_of(queue: str) -> str:
    """The model's queue for ``queue``: itself, or, for a worker's own queue, the queue it was routed from
    (where a requeued message goes, so that a live worker takes it)."""
    return queue.split(DIRECT_QUEUE_INFIX, 1)[0]


def load_settings(config_path: Path | str | None = None, **overrides: Any) -> FleetSettings:
    """Build the process's settings from YAML + environment (+ explicit overrides, highest).

    Args:
        config_path: YAML file; defaults to ``$FLEET_CONFIG`` or ``configs/fleet.yaml`` (missing
            default file = built-in defaults only).
        overrides: top-level fields that beat every other source, ``FLEET_*`` variables included
            (used by CLI flags); a section given as a dict is merged into the section field by field.

    Raises:
        ConfigError: a value broke a rule; the message names the setting (dotted path) and the rule (and
            starts ``override refused:`` when an override broke it); or a ``FLEET_*`` variable of a list or
            section is not JSON (the message names the variable and the form, never its value).
    """
    path = Path(config_path or os.environ.get("FLEET_CONFIG") or DEFAULT_CONFIG_PATH)
    data: dict[str, Any] = {"models": {}}
    read_from = path.resolve() if path.exists() else None
    if read_from is not None:
        loaded = read_yaml(path)
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping", "FLEET_CONFIG", "mapping")
        data = {"models": {}, **loaded}
        resolve_model_paths(data, path.parent)
    elif config_path is not None or "FLEET_CONFIG" in os.environ:
        raise ConfigError(f"config file {path} does not exist", "FLEET_CONFIG", str(path))
    name_env_only_models(data)
    _warn_unknown_env()
    try:
        settings = FleetSettings(**data)
    except ValidationError as exc:
        raise ConfigError(describe(exc), first_loc(exc), None) from exc
    except SettingsError as exc:  # a FLEET_* variable that is not the JSON its setting takes
        message, variable = settings_env_problem(exc)
        raise ConfigError(message, variable, "JSON") from exc
    if overrides:
        merged = deep_merge(settings.model_dump(), overrides)
        token = _OVERRIDING.set(True)  # env and YAML are in ``merged`` already: the environment must not win again
        try:
            settings = FleetSettings(**merged)
        except ValidationError as exc:
            raise ConfigError(f"override refused: {describe(exc)}", first_loc(exc), None) from exc
        finally:
            _OVERRIDING.reset(token)
    settings._config_file = read_from
    return settings


def no_config_file_read() -> str:
    """Why a process has no models when ``FLEET_CONFIG`` is unset and the default file is not where it ran."""
    return (f"no config file was read: {DEFAULT_CONFIG_PATH} is not in {Path.cwd()}; run from the folder that "
            f"holds it, or set FLEET_CONFIG to its path")


def no_models_configured(settings: FleetSettings) -> str:
    """Why a fleet-wide readiness probe fails on settings that configure no model: the file read (or that none
    was, in the words of :func:`no_config_file_read`)."""
    if settings.config_file is None:
        return f"no models configured ({no_config_file_read()})"
    return f"no models configured: {settings.config_file} has none under models"


_OVERRIDING: contextvars.ContextVar[bool] = contextvars.ContextVar("fleet_settings_overriding", default=False)
"""True while :func:`load_settings` applies its overrides: :class:`FleetSettings` then reads no environment."""


NOT_SETTINGS_ENV = frozenset({"FLEET_CONFIG", "FLEET_DEBUG", "FLEET_ORT", "FLEET_GIT_COMMIT", "FLEET_BENCH_PROVIDER",
                              "FLEET_FUZZ_ENVELOPES", "FLEET_API_KEYS", "FLEET_REDIS_PREFLIGHT_PID"})  # fmt: skip
"""``FLEET_*`` variables that are not settings: the config file, ``--debug``, the install's ONNX Runtime build,
the bench's provider and commit, the fuzz tests' size, docker compose's API keys, and the mark ``fleet worker``
leaves for the Celery process it starts (its Redis URL was checked already)."""
_warned_env: set[str] = set()


def _warn_unknown_env() -> None:
    """Log (once per process) each ``FLEET_*`` variable that names no setting: pydantic-settings ignores it,
    so a typo (``FLEET_WORKER_CONCURRENCY``, one underscore) silently left the default in force. A nested
    name that does not exist (``FLEET_WORKER__BOGUS``) is refused by the settings themselves."""
    for var in os.environ:
        name = var.upper()
        if not name.startswith("FLEET_") or name in NOT_SETTINGS_ENV or name in _warned_env:
            continue
        if name[len("FLEET_"):].split("__", 1)[0].lower() in FleetSettings.model_fields:
            continue
        _warned_env.add(name)
        meant = _meant(name[len("FLEET_"):].lower())
        hint = f" (did you mean {meant}?)" if meant else ""
        logging.getLogger("fleet.settings").warning("environment variable %s is not a setting and is ignored%s",
                                                    var, hint)  # fmt: skip


def _meant(rest: str) -> str | None:
    """The setting's variable a mistyped ``FLEET_<rest>`` most likely meant: a section's field written with
    one underscore (``worker_concurrency`` → ``FLEET_WORKER__CONCURRENCY``), else a close top-level name."""
    for name, field in FleetSettings.model_fields.items():
        section = field.annotation
        sub = rest[len(name) + 1 :]
        is_section = isinstance(section, type) and issubclass(section, BaseModel)
        if rest.startswith(name + "_") and is_section and sub in section.model_fields:  # type: ignore[union-attr]
            return f"FLEET_{name.upper()}__{sub.upper()}"
    close = difflib.get_close_matches(rest, list(FleetSettings.model_fields), 1, 0.75)
    return f"FLEET_{close[0].upper()}" if close else None
