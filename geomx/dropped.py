"""Members the schedulers dropped (fault domains), one JSON line each in ``<run dir>/dropped.jsonl``.

The launcher reads it to tell a role its deployment went on without (a worker its DC dropped, a DC's local
server the global tier dropped) from one that failed on its own, whose error must stop the run. Each line is
written with one ``O_APPEND`` write, so the schedulers of one run can share the file.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

FILE = "dropped.jsonl"


def record(run_dir: str | Path | None, *, tier: str, pid: int, member: str, reason: str) -> None:
    if run_dir is None:
        return
    line = json.dumps({"time": time.time(), "tier": tier, "pid": pid, "member": member, "reason": reason}) + "\n"
    fd = os.open(Path(run_dir) / FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class DropLog:
    """The pids dropped so far in one run, read incrementally."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / FILE
        self.pids: set[int] = set()
        self._offset = 0

    def refresh(self) -> set[int]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.pids
        complete = data[:data.rfind(b"\n") + 1]     # a line still being written is read next time
        self._offset += len(complete)
        for line in complete.splitlines():
            try:
                self.pids.add(int(json.loads(line)["pid"]))
            except (ValueError, KeyError, TypeError):
                continue
        return self.pids
