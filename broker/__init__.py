"""The one seam between the fleet and kombu's/Celery's internals: a kombu upgrade is this package to check.

Everything that subclasses, patches or depends on the private behaviour of kombu's Redis transport,
Celery's result backend, its event dispatcher or its message protocol lives here, below both sides:
``producer/`` and ``gateway/`` (which send) and ``workers/`` (which take) import it; it imports only
``protocol/`` (settings, keys, errors, the dead-letter format) and never ``workers/``, ``producer/`` or
``gateway/``. The Celery configuration is handed to it (:func:`make_celery` takes
:func:`protocol.celeryconf.celery_config`'s mapping), so ``protocol/`` never imports kombu's channel.

What it adapts, module by module:

* :mod:`broker.kombu_channel`: kombu's Redis ``Channel`` and ``SentinelChannel`` (``_create_client``:
  one ``redis.Redis`` per channel and pool) and ``QoS`` (``pipe_or_acquire``, ``_remove_from_indices``:
  plain pipelines for the unacked bookkeeping); installed on ``Transport.Channel`` process wide.
* :mod:`broker.poison`: the worker's channel (``_brpop_start``, ``_brpop_read``, ``_connparams``,
  ``_queue_cycle``, ``_in_poll``, ``connection._deliver``, ``virtual.Message._decoded_cache``,
  ``qos._delivered``): every item checked before kombu/Celery decode it, refused ones dead-lettered
  (:mod:`broker.dead_letter_writer`: their FAILURE results through the backend's ``mark_as_failure``, with
  a stand-in for Celery's task ``Request``, and ``store_many``); bound to the worker's app and settings at
  ``celeryd_after_setup`` (:mod:`broker.guard_config`).
* :mod:`broker.atomic_take`, :mod:`broker.batch_take`: the take (a ``BLMOVE`` wait, one Lua script
  writing kombu's unacked hash/index entries in kombu's own format; ``RPOP`` with a count as fallback),
  which depends on kombu's key names (``unacked_key``, ``unacked_index_key``), ``_q_for_pri``,
  ``priority_steps``, ``sep``, ``global_keyprefix`` and ``QoS.can_consume_max_estimate``.
* :mod:`broker.cancel_marks`, :mod:`broker.store_ack`: ``QoS.append`` (the cancel mark read at take)
  and ``QoS.ack`` (a SUCCESS acked inside the result store's script).
* :mod:`broker.result_backend`: Celery's Redis and Sentinel result backends (``_store_result``,
  ``_get_result_meta``, ``ensure``, ``exception_safe_to_retry``): one script per stored state.
* :mod:`broker.event_buffer`: Celery's consumer ``Events`` bootstep and the ``EventDispatcher``'s
  ``_group_buffer``/``_outbound_buffer``/``on_send_buffered``: task events as ``task.multi`` messages.
* :mod:`broker.message_check` (its field rules: :mod:`broker.message_fields`), :mod:`broker.deliveries`:
  Celery's task message protocol 2 (headers, ``[args, kwargs, embed]`` body, kombu's JSON envelope, the
  ``redelivered`` mark);
  :mod:`broker.eta_window`: how far ahead an ``eta`` may be, given kombu's ``visibility_timeout`` (the
  channel's, read at take) and its unacked restore (Celery's ETA caveat for Redis).
* :mod:`broker.redis_refusals`: redis-py's ``BaseParser.EXCEPTION_CLASSES`` (write refusals raised as
  connection errors in a worker process).
* :mod:`broker.priority_lists`: kombu's priority sibling lists (``sep``, ``priority_steps``): a queue's lists, and its
  depth is four ``LLEN`` replies.
* :mod:`broker.queue_weight`: requests waiting (a ``fleet.infer_bulk`` message counts as the requests its
  ``argsrepr`` header says it carries), every queue asked in one script: what ``fleet status``, the gateway's
  ``fleet_queue_depth`` and admission read.
* :mod:`broker.versions`: the pins and the worker's start-up check.
* :mod:`broker.celery_app`: ``WorkController.options`` at ``worker_init`` (mingle and gossip off on every
  worker, however it was started: :func:`quiet_worker`).

Not here yet, and to check on an upgrade as well: ``producer/task_writer.py`` (writes Celery's task message
and its task-sent event itself; kombu's ``_q_for_pri`` and ``_get_publish_topic``), ``workers/trace_guard.py``
(wraps Celery's tracer, ``task.__trace__``) and ``workers/result_repr.py`` (``celery.app.trace.saferepr``).

Pinned to celery ``>=5.7,<5.8`` and kombu ``>=5.7,<5.8`` (:data:`TESTED`, ``setup.py``;
``constraints.txt`` holds the exact versions CI ran: celery 5.7.0, kombu 5.7.0, redis 8.2.0). A worker
refuses any other version at start unless ``worker.allow_untested_kombu`` is set (:data:`OVERRIDE_ENV`).

On an upgrade: diff kombu's ``kombu/transport/redis.py`` (``Channel``, ``QoS``, ``MultiChannelPoller``)
and ``kombu/transport/virtual/base.py``, Celery's ``celery/backends/redis.py``, ``backends/base.py``,
``events/dispatcher.py``, ``worker/consumer/events.py`` and ``app/amqp.py`` (the message layout) for
the names above; move :data:`TESTED` and ``setup.py``'s pins together; run ``tests/unit/test_message_check.py``,
``tests/unit/test_broker_versions.py`` and the integration tests named after these modules
(``test_kombu_channel``, ``test_poison*``, ``test_atomic_take``, ``test_batch_take``, ``test_take_kills``,
``test_cancel_marks``, ``test_store_ack``, ``test_result_store_script``, ``test_event_buffer``,
``test_deliveries``, ``test_write_refusals``, ``test_broker_range``, ``test_sentinel``); then
``make constraints``.

The seam: :data:`__all__` below is what the rest of the fleet may call. Code outside ``broker/``
imports ``from broker import …`` only, never a submodule (``tests/unit/test_broker_seam.py`` checks
``protocol``, ``workers``, ``producer``, ``gateway``, ``tools``, ``bench``, ``store`` and ``planner``).
Tests may import submodules: they check the internals one by one.
"""

from __future__ import annotations

from broker.bulk_trim import bulk_item_without
from broker.cancel_marks import MARKS as CANCEL_MARKS
from broker.celery_app import make_celery, quiet_worker
from broker.eta_window import item_eta_too_far, max_eta_ahead_s
from broker.event_buffer import install as install_event_buffer
from broker.in_hand import IN_HAND as TAKEN_IN_HAND
from broker.message_check import bulk_request_ids
from broker.poison import install as install_poison_guard
from broker.priority_lists import queue_depth, queue_lists
from broker.queue_weight import bulk_argsrepr, mark_bulk_queues, pipe_waiting_counts, waiting_counts, waiting_requests
from broker.result_backend import install as install_result_backend
from broker.result_backend import message_owners
from broker.store_ack import unacked_entry_of
from broker.versions import OVERRIDE_ENV, TESTED, check_broker_versions, installed_versions, untested

__all__ = [
    "CANCEL_MARKS",
    "OVERRIDE_ENV",
    "TAKEN_IN_HAND",
    "TESTED",
    "bulk_argsrepr",
    "bulk_item_without",
    "bulk_request_ids",
    "check_broker_versions",
    "install_event_buffer",
    "install_poison_guard",
    "install_result_backend",
    "installed_versions",
    "item_eta_too_far",
    "make_celery",
    "mark_bulk_queues",
    "max_eta_ahead_s",
    "message_owners",
    "pipe_waiting_counts",
    "queue_depth",
    "queue_lists",
    "quiet_worker",
    "unacked_entry_of",
    "untested",
    "waiting_counts",
    "waiting_requests",
]
