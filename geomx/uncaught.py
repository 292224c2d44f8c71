"""Whether this process is ending on an uncaught exception, and :func:`run_main` for scripts that report a geomx
error in one line instead of a traceback.

A worker's kvstore leaves the deployment at interpreter exit. Leaving with a goodbye tells its DC's scheduler
that the worker finished; when a worker died of an error instead, that goodbye let a DC whose every worker had
"finished" shut down in order while the other DCs waited for it until ``GEOMX_TIMEOUT``. Python runs
``sys.excepthook`` before the exit handlers, so a hook that notes the exception lets the kvstore abort instead:
its schedulers then drop the worker or stop the run at once, naming the error.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

from geomx.errors import ConfigError, GeomxError

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
            note(exc)
            previous(exc_type, exc, tb)

        sys.excepthook = note_then_report


def exception() -> BaseException | None:
    """The uncaught exception this process is ending on, or None."""
    return _exception


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def note(exc: BaseException) -> None:
    """Note ``exc`` as what this process ends on, for a script that reports it itself (:func:`run_main`)."""
    global _exception
    _exception = exc


def run_main(main: Callable[[], int | None], *, prog: str | None = None) -> int:
    """``sys.exit(geomx.run_main(main))``: run a training script's ``main``; a geomx error (a misconfiguration, a
    lost peer) ends it with one line on stderr and status 2 (1 for a lost peer), not a traceback, and its
    kvstore still leaves by aborting, as for an uncaught exception. Other exceptions propagate.

    A script that refuses on its own (``raise SystemExit("...")``, or ``main`` returning a non-zero status) also
    leaves by aborting: a goodbye would tell the others this worker finished, and they would train on without it.
    A refusal with a message is a misconfiguration and stops the run; a bare status is a crash."""
    try:
        status = main() or 0
    except SystemExit as exc:
        if exc.code not in (None, 0):
            note(ConfigError(str(exc.code)) if isinstance(exc.code, str) else exc)
        raise
    except GeomxError as exc:
        note(exc)
        print(f"{prog or os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ConfigError) else 1
    if status:
        note(SystemExit(status))
    return status

