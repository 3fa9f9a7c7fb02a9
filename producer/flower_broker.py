"""Flower's Celery settings for the fleet's Redis: TLS options and Sentinel's master name.

``fleet flower`` runs a bare ``celery flower`` (no ``-A``), whose default app reads its settings from
the module named by ``CELERY_CONFIG_MODULE``: this one. Importing it builds ``broker_url``,
``broker_use_ssl`` and ``broker_transport_options`` exactly as workers and producers get them
(:func:`protocol.redis_conn.celery_redis_config`), from the environment :func:`flower_broker_env`
prepared: ``FLEET_REDIS_URL`` and ``FLEET_REDIS`` (the ``redis`` settings section as JSON: paths
and names only). Without it Flower would reach a ``rediss://`` broker unverified (kombu's
default) and could not reach a ``sentinel://`` one at all.
"""

from __future__ import annotations

import os
from typing import Any

from protocol.redis_conn import celery_redis_config
from protocol.settings import FleetSettings, RedisSettings

__all__ = ["flower_broker_env"]


def flower_broker_env(settings: FleetSettings) -> dict[str, str]:
    """The environment that points a bare ``celery flower`` at ``settings``' Redis (secrets in env, not argv)."""
    return {
        "CELERY_CONFIG_MODULE": __name__,
        "CELERY_BROKER_URL": str(celery_redis_config(settings)["broker_url"]),
        "FLEET_REDIS_URL": settings.redis_url,
        "FLEET_REDIS": settings.redis.model_dump_json(),
    }


def _from_env() -> dict[str, Any]:
    url = os.environ.get("FLEET_REDIS_URL")
    if not url or os.environ.get("CELERY_CONFIG_MODULE") != __name__:  # imported for flower_broker_env only
        return {}
    section = RedisSettings.model_validate_json(os.environ.get("FLEET_REDIS") or "{}")
    settings = FleetSettings.model_construct(redis_url=url, redis=section)
    conf = celery_redis_config(settings)
    conf.pop("result_backend", None)  # Flower reads task states from events, not from the backend
    conf.pop("redis_backend_use_ssl", None)
    conf.pop("result_backend_transport_options", None)
    return conf


globals().update(_from_env())
