"""A global server's checkpoints, for resuming a job whose model lives on the servers (``--update-on server``)
or whose servers compress their replies.

With a server optimizer the weights and the optimizer's state (Adam's moments, momentum) exist only on the
global servers, so the workers' checkpoints (geomx.torch.checkpoint) cannot resume such a job alone; nor can
they bring back what a server's reply codec still owes the workers (its error-feedback residual). At every
checkpoint round, every ``every`` synchronous rounds of every key and at each round the global servers declare
(``--checkpoint-seconds``, geomx.cluster.checkpoint_clock), a global server keeps each key's state *as of that
round* (values are never mutated once set, so the value is kept by reference; the optimizer and codec state
are copied), and once every key it owns has reached the round it writes them in one file, atomically
(geomx.statefile: msgpack, never pickle): ``global-server-<rank>-round-<N>.state``, keeping its last ``keep``.
A server hears of a declared round from rank 0 (``checkpoint_at``) or from the first push of that round that
carries it (``hear``). A declared round that some key has already passed when the server hears of it is skipped
with a warning (a partial checkpoint would be wrong); a resume then takes the latest round every role saved
before it.

Per key it saves the value and the update policy's state (a server optimizer's), and the part of the key's
compression state that serves every client alike (``WireKeyState.shared_state_dict``: the stream of a round's
mean gradient, with its codec memory and residual). What belongs to one client is not carried: a server
optimizer's weight-change streams, one per client, each the other half of that client's weight replica. The
clients of a resumed job are new processes with new ids, and in the HiPS topology they are local servers, which
keep no checkpoint of their half; so the resumed servers send every client the whole weights at init and both
ends start those streams afresh (a worker's checkpoint leaves its replicas out too, geomx.cluster.client). A
resumed job with compressed weight replies therefore goes on from the exact weights, not bit for bit.

Resuming (``geomx launch --resume RUN_DIR`` gives every role ``GEOMX_RESUME_FROM`` and ``GEOMX_RESUME_STEP``,
the step every worker checkpointed; under FSA one step is one round of every key): when the master worker
initializes a key, the server starts it from the saved value, optimizer state and codec state instead of the
master's value (without a server optimizer only the codec state: the workers' checkpoints hold the model), every
worker's init reads those weights, and the key's rounds count on from that step. Per-client counters are not
restored: the resumed job's processes are new clients. A resumed job over another WAN or with another codec
cuts its tensors into other parts (geomx.kvstore.partition); each new part then starts from the saved parts of
its tensor, wherever they were saved, re-cut (geomx.part_state).

Not covered: asynchronous rounds (``dist_async``: no round is common to every key), the local servers' state
(their compression streams start afresh), a restart of one global server inside a running job, and the reply
residuals of algorithms whose rounds are not steps (HFA, DiLoCo: a global average every K2 steps, so a key's
round names no step the workers saved): their global servers write no checkpoint, and a resumed job's reply
streams start afresh, as does any resume that finds no checkpoint of a server that holds no model
(``holds_model``).
"""
from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from geomx import statefile
from geomx.cluster.checkpoint_clock import CheckpointClock
from geomx.cluster.protocol import is_round
from geomx.errors import ConfigError
from geomx.transport.ids import public_name
from geomx.part_state import NotRecuttable, base_key, part_range, recut, recut_stream, saved_pieces

log = logging.getLogger("geomx.server_checkpoint")

FORMAT = "geomx-global-server-checkpoint/1"


_FILE = re.compile(r"global-server-(\d+)-round-(\d+)\.state$")


def checkpoint_name(rank: int, round_: int) -> str:
    return f"global-server-{rank}-round-{round_}.state"


def rounds_saved(directory: Path) -> dict[int, list[int]]:
    """global server rank -> the rounds it has checkpoint files for in ``directory``."""
    return statefile.numbered_files(directory, _FILE)


class ServerCheckpoints:
    """A global server's part in checkpoints: counts each key's rounds, keeps the checkpoint rounds (every
    ``every``, and those declared), writes them when ``saves`` (the server holds state a resume needs), and
    hands out the state it resumes from; ``clock``: rank 0's timekeeper. See the module docstring."""

    def __init__(self, *, rank: int, every: int, directory: Path | None, keep: int = 2, saves: bool = True,
                 holds_model: bool = True, clock: CheckpointClock | None = None, resume_from: Path | None = None,
                 resume_round: int | None = None) -> None:
        self.rank, self.every, self.keep, self.saves, self.clock = rank, every, keep, saves, clock
        # the model lives here (a server optimizer): a resume without its checkpoint is refused; without one the
        # checkpoint holds only reply residuals, and a resume that finds none starts the streams afresh
        self.holds_model = holds_model
        self.directory = directory
        self.rounds: dict[Any, int] = {}                  # key -> synchronous rounds completed
        self._taken: dict[Any, int] = {}                  # key -> rounds it completed in this process
        self.declared: set[int] = set()                   # declared rounds still to write
        self.latest_declared = 0                          # what value replies tell the clients (0: nothing yet)
        self._pending: dict[int, dict[Any, dict]] = {}    # round -> key -> its state at that round
        self._resumed: dict[Any, dict] | None = None
        self._every_server: dict[Any, dict] | None = None     # every global server's saved keys (when needed)
        self._saved_shapes: dict[Any, tuple] = {}              # ... and their shapes (older files: the value's)
        self._ranks_saved: list[int] = []                      # the global servers that saved the round
        self._afresh = False                                   # nothing saved to resume from: streams afresh
        self._warned_mark = False                              # hear() warned of an impossible mark
        self.resume_from, self.resume_round = resume_from, resume_round

    def resumed_state(self, key, shape: tuple) -> dict | None:
        """The key (of ``shape``) was initialized: its rounds count on from the step resumed at. Returns its saved
        state to start from (None: not resuming, or this server saves nothing). Loaded at the first key; no file
        of the round is an error naming this server's. A key this server's file lacks (or a server that saved
        none: the job has more global servers now) is looked up in every global server's file of the round (keys
        are placed by bytes, so another cut or another number of servers places them otherwise), and a part of a
        tensor that the checkpoint cut otherwise is re-cut from the saved parts (:meth:`_recut`)."""
        if self.resume_from is None or self.resume_round is None:
            return None
        self.rounds[key] = self.resume_round
        if not self.saves or self._afresh:
            return None
        if self._resumed is None:
            path = self.resume_from / checkpoint_name(self.rank, self.resume_round)
            ranks = [r for r, rounds in rounds_saved(self.resume_from).items() if self.resume_round in rounds]
            if not ranks and not self.holds_model:
                log.warning("global server %d: no global server checkpointed round %d in %s: the reply streams "
                            "start afresh (their residuals of the run resumed are lost)", self.rank,
                            self.resume_round, self.resume_from)
                self._afresh = True
                return None
            if not ranks:
                raise ConfigError(f"cannot resume global server {self.rank} at round {self.resume_round}: {path} "
                                  f"does not exist (the run was not checkpointed at that step with a server "
                                  f"optimizer or compression: was it run with --update-on server? Resume with the "
                                  f"--update-on of the run it resumes)")
            # a job resumed with more global servers than it saved: this one's keys are all in the others' files
            self._resumed = self._entries(path) if path.exists() else {}
            self._ranks_saved = ranks
        entry = self._resumed.get(key)
        if entry is None:
            if self._every_server is None:
                self._every_server = {}
                for rank in self._ranks_saved:
                    path = self.resume_from / checkpoint_name(rank, self.resume_round)
                    self._every_server.update(self._entries(path, rank))
                self._saved_shapes = {k: tuple(e["shape"]) if "shape" in e else np.shape(e["value"])
                                      for k, e in self._every_server.items()
                                      if "shape" in e or e.get("value") is not None}
            entry = self._every_server.get(key)
            if entry is None and not self.holds_model and not saved_pieces(base_key(key), self._saved_shapes,
                                                                            self._every_server):
                return None     # only reply residuals were saved, and this key took no rounds (a fused model's)
            entry = entry or self._recut(key, shape)
        return entry

    def _entries(self, path: Path, rank: int | None = None) -> dict:
        saved = statefile.load(path)
        if saved.get("format") != FORMAT or saved.get("rank") != (self.rank if rank is None else rank):
            raise ConfigError(f"{path} is not global server {self.rank if rank is None else rank}'s checkpoint")
        return {entry["key"]: entry for entry in saved["keys"]}

    def _recut(self, key, shape: tuple) -> dict:
        """``key``'s state cut from the saved parts of its tensor (geomx.part_state): the job resumed cuts its
        tensors otherwise (another WAN's part size, another codec's wire ratio, P3's slices)."""
        pieces = saved_pieces(base_key(key), self._saved_shapes, self._every_server)
        if not pieces:
            raise ConfigError(f"key {key!r} is not in the global servers' checkpoint of round {self.resume_round} "
                              f"(keys: {sorted(map(repr, self._every_server))[:8]})")
        start, stop = part_range(key, shape, pieces[-1].stop)
        saved = [p.state for p in pieces]
        try:
            entry = {name: None if saved[0][name] is None else
                     recut(pieces, start, stop, shape, shaped=True, states=[s[name] for s in saved])
                     for name in ("value", "update")}
        except NotRecuttable as exc:
            raise ConfigError(f"key {key!r}: the checkpoint cut its tensor into {len(pieces)} part(s), and its "
                              f"server optimizer's state cannot be cut otherwise ({exc})") from None
        down = [None if s["wire"] is None else s["wire"]["down"] for s in saved]
        entry["wire"] = None if saved[0]["wire"] is None else {
            "down": recut_stream([replace(p, state=d) for p, d in zip(pieces, down, strict=True)], start, stop)}
        log.info("global server %d: key %r resumed from the checkpoint's %d part(s) of its tensor, cut otherwise",
                 self.rank, key, len(pieces))
        return {"key": key, "shape": list(shape), **entry}

    # rounds -------------------------------------------------------------------------------------------------
    def round_done(self, st, keys: int) -> int | None:
        """``st``'s key finished a synchronous round; ``keys``: how many keys the server owns. Keeps the key's
        state if the round is a checkpoint round. Returns the round the timekeeper declares now, if any (the
        caller tells the other global servers)."""
        n = self.rounds[st.key] = self.rounds.get(st.key, 0) + 1
        self._taken[st.key] = self._taken.get(st.key, 0) + 1
        keys = self._keys_in_rounds(keys)
        if self.writes and self._checkpoint_round(n):
            self._pending.setdefault(n, {})[st.key] = {
                "key": st.key, "shape": list(st.shape), "value": st.value if st.update is not None else None,
                "update": st.update.state_dict() if st.update is not None else None,
                "wire": st.wire.shared_state_dict() if st.wire is not None else None}
        for round_ in [r for r, pending in self._pending.items() if len(pending) == keys]:
            self.declared.discard(round_)
            self._write(round_, self._pending.pop(round_))
        if self.clock is None or not self.clock.due() or len(self._taken) < keys:
            return None
        taken = [self.rounds[key] for key in self._taken]
        declared = self.clock.declare(max(taken), min(taken))
        if declared is not None:
            self.declare(declared)
        return declared

    def _keys_in_rounds(self, owned: int) -> int:
        """How many of the ``owned`` keys take rounds. With a server optimizer, all of them. Without one, FSA
        fuses tensors: the workers push buckets, and the parameters' own keys are only read (their initial
        values). FSA's step() waits for every reply of round m before any push of round m + 1, so once a key has
        completed two rounds here, every key that takes rounds has completed one, and those that did are all of
        them. Before that, every key owned counts (a round-1 checkpoint waits until then). Rounds that a resumed
        key counts on from do not count here: the keys only read are resumed too."""
        if self.holds_model:
            return owned
        return len(self._taken) if max(self._taken.values(), default=0) >= 2 else owned

    def hear(self, round_, *, key=None, src: str | None = None) -> bool:
        """A round declared by the timekeeper, heard from rank 0's ``checkpoint_at`` or (``key``) marked on a push
        of ``key`` from ``src``: declared here unless heard already. A push's mark is taken only if it is possible.
        Rank 0 declares r = M + 2 after completing round M of a key, and every key had completed round M - 1 by
        then (no client pushes round M before it has every reply of round M - 1). So a reply marked r is of round
        M or later, a client that has one pushes round M or later, and it pushes round M of ``key`` only once
        it has this server's reply of round M - 1: ``key`` has completed at least r - 3 rounds here. A mark
        beyond that, from a faulty client, would make this server skip the real declarations up to it: ignored,
        with one warning per server."""
        if not is_round(round_) or round_ <= self.latest_declared:
            return False
        if key is not None and round_ > self.rounds.get(key, 0) + 3:
            if not self._warned_mark:
                self._warned_mark = True
                log.warning("global server %d: push of key %r from %s marks checkpoint round %d, but the key has "
                            "completed %d rounds here: mark ignored (and any such mark from now on, silently)",
                            self.rank, key, public_name(src or ""), round_, self.rounds.get(key, 0))
            return False
        return self.declare(round_)

    def declare(self, round_: int) -> bool:
        """Checkpoint every key as of ``round_`` (the timekeeper's declaration). Skipped, with a warning, when a
        key has completed that round already: its state then is gone, and half a checkpoint would be wrong."""
        self.latest_declared = max(self.latest_declared, round_)
        if not self.writes:
            return False
        passed = max(self.rounds.values(), default=0)
        if passed >= round_:
            log.warning("global server %d: checkpoint of round %d skipped: it heard of it after completing round %d "
                        "of a key (a resume takes an earlier round)", self.rank, round_, passed)
            return False
        self.declared.add(round_)
        return True

    @property
    def writes(self) -> bool:
        return self.saves and self.directory is not None

    def _checkpoint_round(self, n: int) -> bool:
        return (self.every > 0 and n % self.every == 0) or n in self.declared

    def _write(self, round_: int, keys: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # in key order, not in the order the keys finished the round (a race): equal states, equal files
        ordered = [keys[k] for k in sorted(keys, key=repr)]
        statefile.save(self.directory / checkpoint_name(self.rank, round_),
                       {"format": FORMAT, "rank": self.rank, "round": round_, "keys": ordered})
        saved = sorted(rounds_saved(self.directory).get(self.rank, []))
        for old in saved[:-self.keep]:
            (self.directory / checkpoint_name(self.rank, old)).unlink(missing_ok=True)
        log.info("global server %d: checkpoint of round %d written (%d keys)", self.rank, round_, len(keys))
