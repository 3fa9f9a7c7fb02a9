"""A Celery app on the fleet's kombu channel, built from the configuration :mod:`protocol.celeryconf` derives.

The configuration (JSON only, reliability settings, routing) is the protocol's; which kombu channel
carries it is the broker's. Producers, the gateway and the worker build their app here, with
``celery_config(settings)`` handed in, so ``protocol/`` never imports kombu's channel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery

from broker import kombu_channel
from protocol.redis_conn import MaskedConnection

__all__ = ["make_celery"]


def make_celery(conf: Mapping[str, Any], name: str = "onnx-fleet") -> Celery:
    """A Celery app configured with ``conf`` (:func:`protocol.celeryconf.celery_config`), no tasks registered
    (producers use it as is).

    Installs :mod:`broker.kombu_channel`'s channels process wide first (one ``redis.Redis`` per channel,
    not one per command sent); a worker's guarded channel, already installed, is kept. ``conf`` must
    hold ``broker_url`` and ``result_backend`` (``KeyError`` otherwise).
    """
    kombu_channel.install()  # one redis.Redis per channel, not one per command sent
    app = Celery(name, broker=conf["broker_url"], backend=conf["result_backend"], set_as_current=False)
    app.conf.update(conf)
    app.amqp.Connection = MaskedConnection  # URLs in Celery's own lines: ':***@' only when there is a password
    return app
