"""Members the schedulers dropped (fault domains), one JSON line each in ``<run dir>/dropped.jsonl``, and members
whose own abort stopped a tier, in ``<run dir>/aborted.jsonl``.

The launcher reads the first to tell a role its deployment went on without (a worker its DC dropped, a DC's
local server the global tier dropped) from one that failed on its own, whose error must stop the run; and the
second to name the role a failure started from: a worker that died of an error aborts, and the schedulers and
servers its abort reaches stop, often before its own process has exited. Each line is written with one
``O_APPEND`` write, so the schedulers of one run can share a file, in the order the aborts travelled.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

FILE = "dropped.jsonl"
ABORTED_FILE = "aborted.jsonl"


def record(run_dir: str | Path | None, *, tier: str, pid: int, member: str, reason: str, file: str = FILE,
           own_abort: bool = False) -> None:
    """``own_abort``: the member aborted itself (an error of its own), rather than fell silent."""
    if run_dir is None:
        return
    line = json.dumps({"time": time.time(), "tier": tier, "pid": pid, "member": member, "reason": reason,
                       **({"own_abort": True} if own_abort else {})}) + "\n"
    fd = os.open(Path(run_dir) / file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class DropLog:
    """The pids recorded so far in one run's ``file`` (dropped members by default), read incrementally;
    ``order``: the same pids in the order they were first recorded; ``reasons`` and ``members``: the first reason
    given for each, and the member named; ``own_aborts``: those a scheduler dropped because they aborted
    themselves (an error of their own)."""

    def __init__(self, run_dir: str | Path, *, file: str = FILE) -> None:
        self.path = Path(run_dir) / file
        self.pids: set[int] = set()
        self.order: list[int] = []
        self.reasons: dict[int, str] = {}
        self.members: dict[int, str] = {}
        self.own_aborts: set[int] = set()
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
                entry = json.loads(line)
                pid = int(entry["pid"])
            except (ValueError, KeyError, TypeError):
                continue
            if pid not in self.pids:
                self.pids.add(pid)
                self.order.append(pid)
                self.reasons[pid] = str(entry.get("reason", ""))
                self.members[pid] = str(entry.get("member", "?"))
            if entry.get("own_abort") is True:
                self.own_aborts.add(pid)
        return self.pids

    def restartable(self) -> set[int]:
        """The pids dropped for falling silent (killed, frozen, cut off), read afresh: a role that aborted on an
        error of its own would fail again (geomx.cli.rejoins), and it exits by itself."""
        return self.refresh() - self.own_aborts
