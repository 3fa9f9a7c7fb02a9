"""A process that dies inside kombu's restore scan, holding the scan's lock.

``python -m tests.integration.restore_lock_holder`` (settings from ``$FLEET_CONFIG``) builds the fleet's
Celery app and channel, takes the lock kombu's ``QoS.restore_visible`` takes before each scan (kombu's own
``Mutex``, with the key and life the fleet's transport options give the channel), prints ``holding <token>``
(the lock's value) and SIGKILLs itself: the state in Redis a worker killed mid-scan leaves behind, and the
one a worker cut off from Redis one way leaves (its ``SET … NX`` arrives, the reply does not).
"""

from __future__ import annotations

import os
import signal
import sys

from kombu.transport.redis import Mutex

from broker import make_celery
from protocol.celeryconf import celery_config
from protocol.settings import load_settings


def main() -> None:
    app = make_celery(celery_config(load_settings()), "restore-lock-holder")
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as client, Mutex(client, channel.unacked_mutex_key,
                                                       channel.unacked_mutex_expire):
            token = client.get(channel.unacked_mutex_key)
            print("holding", token.decode() if token else "", flush=True)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
