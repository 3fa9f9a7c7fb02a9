"""A SIGTERM always stops ``fleet flower`` (:mod:`producer.flower_main`), even when it lands in a finalizer.

Flower's own handler raises ``SystemExit``; Python runs a signal handler between bytecodes of whatever the
main thread runs, and drops an exception raised inside a weakref callback ("Exception ignored in …"). A
fresh-clone run caught Flower logging "15 detected, shutting down" and serving on. Each script below sends
itself SIGTERM from inside a weakref callback, with a handler installed, then runs a Tornado loop: the
handler that raises is lost there and the loop runs on (exit 3 after its 10 s bound); the one that stops
the loop stops it as soon as it starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import gc, os, signal, sys, weakref
sys.path.insert(0, {root!r})
from tornado.ioloop import IOLoop
if sys.argv[1] == "flower":
    from flower.command import sigterm_handler as handler
else:
    from producer.flower_main import stop_on_sigterm as handler
signal.signal(signal.SIGTERM, handler)
loop = IOLoop.current()

class Held:
    pass

def finalizer(_ref):
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # the handler runs at the loop's first backward jump, inside the callback
        pass

held = Held()
ref = weakref.ref(held, finalizer)
del held
gc.collect()
loop.call_later(10.0, lambda: (print("still serving after the SIGTERM", flush=True), os._exit(3)))
loop.start()
print("stopped", flush=True)
"""


@pytest.mark.parametrize(("handler", "code", "out"), [("fleet", 0, "stopped"), ("flower", 3, "still serving")])
def test_a_sigterm_in_a_finalizer_stops_flower_s_loop(tmp_path: Path, handler: str, code: int, out: str) -> None:
    script = tmp_path / "sigterm_in_finalizer.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).resolve().parents[2])))
    done = subprocess.run([sys.executable, str(script), handler], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stdout + done.stderr
    assert out in done.stdout, done.stdout + done.stderr
    if handler == "flower":  # the mechanism: Flower's SystemExit was dropped in the callback
        assert "Exception ignored" in done.stderr and "SystemExit" in done.stderr, done.stderr
