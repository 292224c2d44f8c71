"""Time-based checkpoints (``geomx launch --checkpoint-seconds S``): which round every role checkpoints at.

Every worker and every checkpointing global server must save the *same* step, or a resumed job finds no step
they all have; their clocks and step times differ, so none may decide alone. One process keeps the time and
names a round: global server rank 0 (it sees rounds complete, with or without a server optimizer; it owns a key
as soon as there is one, the master worker placing the first key on the least loaded server, rank 0 on a tie).

Once S seconds have passed since its last declaration (or since it started), and every key it owns has
completed the round declared last, the next synchronous round it completes on any of its keys makes it declare
``r = M + 2``, M being the most rounds completed on any key it owns. It then tells the other global servers
(``checkpoint_at``) and marks every value reply it sends from then on with ``checkpoint_round: r`` (so do the
others once they heard it; a local server passes the latest it heard on to its workers). Why ``+ 2``: a worker
pushes round m + 2 only once it has every reply of round m + 1 (FSA waits for them in ``step()``, P3 in the
next forward pass), rank 0's keys included, and rank 0 has completed no key's round M + 1 yet. So:

* no server has completed round r: its pushes of round r come from clients that finished step M + 1, which
  waited for rank 0's replies of round M + 1, sent after the declaration. ``checkpoint_at`` goes out first, but
  another path may overtake it (it did on a loaded CI machine), so every push also carries the latest round its
  client heard (a local server's, the latest its upstream client heard): a server hears of r at the latest
  with the first push of round r it receives, before any key of it can complete round r
  (``ServerCheckpoints.hear``). A server that still heard only after completing round r of a key skips that
  checkpoint (logged, never partial);
* every worker hears r before it finishes step r: it needs rank 0's replies of round r - 1 = M + 1, all marked
  r. The next declaration waits until every key of rank 0 completed round r, so no reply marks a later round
  before every worker (and local server) has all replies of round r - 1: a reply carries only the latest round,
  and a local server passes on the latest it heard, without hiding r.

That holds where one step is one synchronous round of every key (``round_per_step`` algorithms: fsa, p3; not
``dist_async``): geomx.compat refuses the rest. Both intervals may be given; a step is checkpointed when either
asks.
"""
from __future__ import annotations

import time
from collections.abc import Callable


class CheckpointClock:
    """Global server rank 0's timekeeper: after every round it completes, :meth:`declare` once :meth:`due`."""

    def __init__(self, seconds: float, *, now: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self._now = seconds, now
        self._since = now()
        self.declared = 0           # the latest round declared (0: none yet)

    def due(self) -> bool:
        """S seconds have passed since the last declaration (or the start)."""
        return self._now() - self._since >= self.seconds

    def declare(self, most_rounds: int, fewest_rounds: int) -> int | None:
        """The most and the fewest rounds completed on any key this server owns; the round to checkpoint at, or
        None while the last declared round is under way."""
        if fewest_rounds < self.declared:
            return None
        self.declared, self._since = most_rounds + 2, self._now()
        return self.declared
