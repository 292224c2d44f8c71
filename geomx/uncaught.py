"""Whether this process is ending on an uncaught exception.

A worker's kvstore leaves the deployment at interpreter exit. Leaving with a goodbye tells its DC's scheduler
that the worker finished; when a worker died of an error instead, that goodbye let a DC whose every worker had
"finished" shut down in order while the other DCs waited for it until ``GEOMX_TIMEOUT``. Python runs
``sys.excepthook`` before the exit handlers, so a hook that notes the exception lets the kvstore abort instead:
its schedulers then drop the worker or stop the run at once, naming the error.
"""
from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_installed = False
_exception: BaseException | None = None


def watch() -> None:
    """Note the exception, if any, that ends this process (once per process; the previous hook still runs)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        previous = sys.excepthook

        def note_then_report(exc_type, exc, tb) -> None:
            global _exception
            _exception = exc
            previous(exc_type, exc, tb)

        sys.excepthook = note_then_report


def exception() -> BaseException | None:
    """The uncaught exception this process is ending on, or None."""
    return _exception


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
