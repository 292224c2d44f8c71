"""MixedSync ``overlap``: a local server answers its DC's round at once; the WAN exchange runs behind it.

In GeoMX's MixedSync (``wait``) every DC round is a WAN round trip: the local server pushes the DC's sum to
the global server and answers its workers with the reply, so a DC never waits for another DC but always waits
for the WAN (180 ms a step over the Pacific, however fast it computes). With ``overlap`` the answer to round n
is the DC's own contribution (its sum / all workers, what the global server would have relayed) plus every
other DC's gradient that arrived since round n-1; the DC's sum goes up in the background.

At most one WAN round per key is in flight: DC rounds that finish meanwhile are summed and go up together when
it returns, so a DC that steps faster than the round trip neither queues work on the link nor drops anything.
Nothing is lost: every gradient reaches every DC exactly once, a DC's own in the very next reply, another DC's
in the first DC round after the WAN reply that carried it (about one round trip late: bounded staleness). The
global server relays to each DC only the others' pushes (``GradientRelay(echo_own=False)``). Worker-side
updates only: with a server optimizer the weights a worker needs exist only after the WAN round.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geomx.cluster.client import Handle
from geomx.cluster.round_policies import register_round_policy
from geomx.config import round_divisor
from geomx.cluster.kvserver import KeyState, Round
from geomx.errors import PeerLostError


@dataclass
class OverlapState:
    """One key's WAN exchange under overlap. A round in flight when the state is saved is the global server's
    to finish: a restored state starts with none in flight (its DC sum went up; the reply is lost with the
    connection), so save between rounds."""
    outbox: np.ndarray | None = None     # DC sums not yet sent
    inbox: np.ndarray | None = None      # other DCs' gradients not yet handed to the workers
    in_flight: bool = False
    wan_error: str | None = None
    wan_lost: bool = False

    def state_dict(self) -> dict:
        return {"outbox": self.outbox, "inbox": self.inbox, "wan_error": self.wan_error, "wan_lost": self.wan_lost}

    def load_state_dict(self, state: dict) -> None:
        self.outbox = None if state["outbox"] is None else np.array(state["outbox"])
        self.inbox = None if state["inbox"] is None else np.array(state["inbox"])
        self.in_flight, self.wan_error, self.wan_lost = False, state["wan_error"], state["wan_lost"]


@register_round_policy("overlap")
class WanOverlap:
    """Per-key state lives in ``st.overlap`` (:class:`OverlapState`)."""

    def __init__(self, server) -> None:
        self.server = server     # the LocalServer: set_value, fail_waiting, upstream, info

    def on_round(self, st: KeyState, number: int, rnd: Round) -> None:
        s = st.overlap
        if s is None:
            s = st.overlap = OverlapState()
        if s.wan_error:
            self.server.fail_waiting(st, s.wan_error, lost=s.wan_lost)
            return
        # the deployment's reduction: what the global server relays is the sum, or the sum / all workers
        info = self.server.info
        divisor = np.float32(round_divisor(info.get("reduction", "mean"), info["num_all_workers"]))
        value = np.divide(rnd.total, divisor, dtype=np.float32)
        inbox, s.inbox = s.inbox, None
        if inbox is not None:
            value += inbox
        self.server.set_value(st, value.astype(st.dtype, copy=False), rnd.contributors)
        # the round's total may be a received, read-only buffer: sum into a new array
        s.outbox = rnd.total if s.outbox is None else np.add(s.outbox, rnd.total)
        if not s.in_flight:
            self._send(st)

    def _send(self, st: KeyState) -> None:
        s = st.overlap
        total, s.outbox = s.outbox, None
        s.in_flight = True
        # the sender count scales what travels (a sum goes as sum / count, see compressed.dense_push): it must
        # not change from push to push, or an error-feedback residual kept at one scale is sent at another.
        # Summed rounds therefore go with the DC's configured workers, the count of every single round (a round
        # short of a dropped worker is scaled to that size, LocalServer.stand_in_for_departed).
        h = self.server.upstream.pushpull(st.key, total, count=self.server.po.cfg.num_workers)
        h.add_done_callback(lambda h: self._returned(st, h))

    def _returned(self, st: KeyState, h: Handle) -> None:
        s = st.overlap
        s.in_flight = False
        if h.error is not None:
            s.wan_error = f"a global round of key {st.key!r} failed: {h.error}"
            s.wan_lost = isinstance(h.error, PeerLostError)
            self.server.fail_waiting(st, s.wan_error, lost=s.wan_lost)
            return
        others = np.asarray(h.result, dtype=np.float32)
        s.inbox = others.copy() if s.inbox is None else np.add(s.inbox, others, out=s.inbox)
        if s.outbox is not None:
            self._send(st)
