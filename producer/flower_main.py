"""``fleet flower``'s process: ``celery flower`` with a SIGTERM that always stops it.

Flower 2.2's ``celery flower`` stops on SIGTERM by raising ``SystemExit`` from its signal handler
(``flower.command.sigterm_handler``). Python runs a signal handler between bytecodes of whatever the main
thread runs, finalizers included, and an exception raised inside a weakref callback or a ``__del__`` is
printed ("Exception ignored in …") and dropped: a fresh-clone test run caught a Flower that logged
"15 detected, shutting down", lost the ``SystemExit`` that way, and kept serving until a second signal. A
service manager's SIGTERM would then end in a SIGKILL, and the state Flower saves on a clean stop
(``--persistent``) would be lost.

Here SIGTERM raises nothing: :func:`stop_on_sigterm` asks Flower's Tornado loop to stop, Flower's
``start()`` returns, and the process ends the way a clean stop does (``atexit``: Flower saves its state).
The handler replaces Flower's by name before its command installs it (the command reads the module's
``sigterm_handler`` when it runs); :data:`FLOWER_SERIES` is the release series this was tested with.
"""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

__all__ = ["FLOWER_SERIES", "main", "stop_on_sigterm"]

log = logging.getLogger("flower.command")

FLOWER_SERIES = "2.2."
"""Flower releases whose command installs ``flower.command.sigterm_handler`` by name (tested: 2.2.0)."""


def stop_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    """Stop Flower's loop from a signal handler: schedule the stop on the loop, raise nothing (so a signal
    that lands in a finalizer is not lost with an exception there)."""
    from tornado.ioloop import IOLoop

    log.info("%s detected, shutting down", signum)
    loop = IOLoop.current()
    loop.asyncio_loop.call_soon_threadsafe(loop.stop)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    """``celery <argv>`` (``flower …``) with :func:`stop_on_sigterm` as Flower's SIGTERM handler."""
    import flower
    import flower.command

    if not str(flower.__version__).startswith(FLOWER_SERIES) or not hasattr(flower.command, "sigterm_handler"):
        log.warning("flower %s is not the %sx series fleet flower was tested with: its own SIGTERM handler "
                    "stays", flower.__version__, FLOWER_SERIES)  # fmt: skip
    flower.command.sigterm_handler = stop_on_sigterm
    from celery.__main__ import main as celery_main

    sys.argv = ["celery", *(sys.argv[1:] if argv is None else argv)]
    celery_main()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # also before Flower's command installs it
    main()
