"""A global server's checkpoints, for resuming a job whose model lives on the servers (``--update-on server``).

With a server optimizer the weights and the optimizer's state (Adam's moments, momentum) exist only on the
global servers, so the workers' checkpoints (geomx.torch.checkpoint) cannot resume such a job alone. Every
``every`` synchronous rounds of every key, a global server keeps each key's value and update state *as of that
round* (values are never mutated once set, so the value is kept by reference; the optimizer state is copied),
and once every key it owns has reached the round it writes them in one file, atomically (geomx.statefile:
msgpack, never pickle): ``global-server-<rank>-round-<N>.state``, keeping its last ``keep``.

Resuming (``geomx launch --resume RUN_DIR`` gives every role ``GEOMX_RESUME_FROM`` and ``GEOMX_RESUME_STEP``,
the step every worker checkpointed; under FSA one step is one round of every key): when the master worker
initializes a key, the server starts it from the saved value and optimizer state instead of the master's
value, and every worker's init reads those weights. Per-client counters are not restored: the resumed job's
processes are new clients.

Not covered: asynchronous rounds (``dist_async``: no round is common to every key), the global servers'
compression residuals (a resumed job starts its codecs afresh), and a restart of one global server inside a
running job.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from geomx import statefile
from geomx.errors import ConfigError

log = logging.getLogger("geomx.server_checkpoint")

FORMAT = "geomx-global-server-checkpoint/1"


_FILE = re.compile(r"global-server-(\d+)-round-(\d+)\.state$")


def checkpoint_name(rank: int, round_: int) -> str:
    return f"global-server-{rank}-round-{round_}.state"


def rounds_saved(directory: Path) -> dict[int, list[int]]:
    """global server rank -> the rounds it has checkpoint files for in ``directory``."""
    return statefile.numbered_files(directory, _FILE)


class ServerCheckpoints:
    """Writes a global server's checkpoints and hands out the one it resumes from; see the module docstring."""

    def __init__(self, *, rank: int, every: int, directory: Path | None, keep: int = 2,
                 resume_from: Path | None = None, resume_round: int | None = None) -> None:
        self.rank, self.every, self.directory, self.keep = rank, every, directory, keep
        self.rounds: dict[Any, int] = {}                  # key -> synchronous rounds completed
        self._pending: dict[int, dict[Any, dict]] = {}    # round -> key -> its state at that round
        self._resumed: dict[Any, dict] | None = None
        self.resume_from, self.resume_round = resume_from, resume_round

    def resumed_state(self, key) -> dict | None:
        """The saved value and update state of ``key`` to start from (None: not resuming). Loaded at the first
        key; a missing file is an error naming it."""
        if self.resume_from is None or self.resume_round is None:
            return None
        if self._resumed is None:
            path = self.resume_from / checkpoint_name(self.rank, self.resume_round)
            if not path.exists():
                raise ConfigError(f"cannot resume global server {self.rank} at round {self.resume_round}: {path} "
                                  f"does not exist (the run was not checkpointed at that step with a server "
                                  f"optimizer)")
            saved = statefile.load(path)
            if saved.get("format") != FORMAT or saved.get("rank") != self.rank:
                raise ConfigError(f"{path} is not global server {self.rank}'s checkpoint")
            self._resumed = {entry["key"]: entry for entry in saved["keys"]}
        entry = self._resumed.get(key)
        if entry is None:
            raise ConfigError(f"key {key!r} is not in global server {self.rank}'s checkpoint of round "
                              f"{self.resume_round} (keys: {sorted(map(repr, self._resumed))[:8]})")
        self.rounds[key] = self.resume_round
        return entry

    def round_done(self, st, keys: int) -> None:
        """``st``'s key finished a synchronous round; ``keys``: how many keys the server owns."""
        n = self.rounds[st.key] = self.rounds.get(st.key, 0) + 1
        if self.every <= 0 or self.directory is None or n % self.every:
            return
        pending = self._pending.setdefault(n, {})
        pending[st.key] = {"key": st.key, "value": st.value,
                           "update": st.update.state_dict() if st.update is not None else None}
        if len(pending) == keys:
            self._write(n, self._pending.pop(n))

    def _write(self, round_: int, keys: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        statefile.save(self.directory / checkpoint_name(self.rank, round_),
                       {"format": FORMAT, "rank": self.rank, "round": round_, "keys": list(keys.values())})
        saved = sorted(rounds_saved(self.directory).get(self.rank, []))
        for old in saved[:-self.keep]:
            (self.directory / checkpoint_name(self.rank, old)).unlink(missing_ok=True)
        log.info("global server %d: checkpoint of round %d written (%d keys)", self.rank, round_, len(keys))
