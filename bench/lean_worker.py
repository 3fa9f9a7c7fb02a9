"""Measurement tool: the fleet's own worker with Celery settings overridden from the environment.

``BENCH_CELERY_OVERRIDES`` (a JSON object of Celery settings) is applied to :data:`workers.app.app`
before the worker starts, so the bench can price Celery's per-task extras (task events, the
STARTED state, extended results) without changing the fleet's code. Not for production use.

Run: ``BENCH_CELERY_OVERRIDES='{"task_track_started": false}' python -m bench.lean_worker worker -P threads …``
"""

from __future__ import annotations

import json
import os
import sys

from workers.app import app

app.conf.update(json.loads(os.environ.get("BENCH_CELERY_OVERRIDES", "{}")))

if __name__ == "__main__":
    app.worker_main(sys.argv[1:])
