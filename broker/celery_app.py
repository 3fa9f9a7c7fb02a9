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

__all__ = ["QUIET_WORKER_OPTIONS", "make_celery", "quiet_worker"]

QUIET_WORKER_OPTIONS = {"without_mingle": True, "without_gossip": True}
"""What every fleet worker runs with, whatever its command line (``fleet worker`` also passes
``--without-mingle --without-gossip``; a plain ``celery -A workers.app worker`` did not):

* mingle's replies from the other workers arrive on a list this worker takes from
  (``<id>.reply.celery.pidbox``), through the poison guard, which dead-lettered each one as
  ``bad_headers``: they are not task messages; and the fleet keeps no state mingle would sync
  (revokes are cancel marks in Redis: :mod:`broker.cancel_marks`);
* gossip has each worker consume every other worker's events; the fleet's presence is its heartbeats.
"""


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


def quiet_worker(worker: Any) -> None:
    """Turn mingle and gossip off on a worker being set up (:data:`QUIET_WORKER_OPTIONS`).

    Call at ``worker_init``: Celery 5.7's ``WorkController`` keeps its options in ``worker.options``, the very
    dict its blueprint, and then its consumer's (``worker_options``), are applied with after that signal;
    Mingle and Gossip read ``without_mingle``/``without_gossip`` from it.
    """
    worker.options.update(QUIET_WORKER_OPTIONS)
