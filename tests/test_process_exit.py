"""A role's process ends cleanly: nothing it started in the background is still inside native code when the
interpreter finalizes (a thread that is gets the process aborted with signal 6, and the launcher then stops
the whole deployment as failed)."""
from __future__ import annotations

import importlib
import threading
import time
from types import SimpleNamespace

from geomx.cluster import global_server


def test_a_global_server_whose_run_ends_before_torch_is_imported_waits_for_the_import(monkeypatch):
    """A short run (2 steps of 1 MB) can end while the background import of torch is still under way; the
    server must wait for it (CI once saw 'terminate called without an active exception' there)."""
    imported = threading.Event()
    real_import = importlib.import_module

    def slow_import(name, *args):
        if name != "torch":
            return real_import(name, *args)
        time.sleep(0.5)
        imported.set()
        return real_import(name)

    def finished_at_once(cfg, done):
        done.set()
        return SimpleNamespace(po=SimpleNamespace(close=lambda: None, aborted=False))

    monkeypatch.setattr(importlib, "import_module", slow_import)
    monkeypatch.setattr(global_server, "start_global_server", finished_at_once)
    assert global_server.run_global_server(cfg=None) == 0
    assert imported.is_set(), "the server returned while torch was still importing"
