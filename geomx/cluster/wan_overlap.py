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

import numpy as np

from geomx.cluster.client import Handle
from geomx.cluster.kvserver import KeyState, Round
from geomx.errors import PeerLostError


class WanOverlap:
    """Per-key state lives in ``st.state``: ``outbox`` (DC sums not yet sent), ``inbox`` (other DCs' gradients
    not yet handed out), ``in_flight``, ``wan_error``."""

    def __init__(self, server) -> None:
        self.server = server     # the LocalServer: set_value, fail_waiting, upstream, info

    def on_round(self, st: KeyState, rnd: Round) -> None:
        s = st.state
        if s.get("wan_error"):
            self.server.fail_waiting(st, s["wan_error"], lost=s.get("wan_lost", False))
            return
        divisor = np.float32(self.server.info["num_all_workers"])
        value = np.divide(rnd.total, divisor, dtype=np.float32)
        inbox = s.pop("inbox", None)
        if inbox is not None:
            value += inbox
        self.server.set_value(st, value.astype(st.dtype, copy=False), rnd.contributors)
        total = s.get("outbox")
        # the round's total may be a received, read-only buffer: sum into a new array
        s["outbox"] = rnd.total if total is None else np.add(total, rnd.total)
        if not s.get("in_flight"):
            self._send(st)

    def _send(self, st: KeyState) -> None:
        total = st.state.pop("outbox")
        st.state["in_flight"] = True
        # the sender count scales what travels (a sum goes as sum / count, see compressed.dense_push): it must
        # not change from push to push, or an error-feedback residual kept at one scale is sent at another.
        # Summed rounds therefore go with the DC's workers, the count of every single round.
        h = self.server.upstream.pushpull(st.key, total, count=self.server.expected_contributors(st))
        h.add_done_callback(lambda h: self._returned(st, h))

    def _returned(self, st: KeyState, h: Handle) -> None:
        s = st.state
        s["in_flight"] = False
        if h.error is not None:
            s["wan_error"] = f"a global round of key {st.key!r} failed: {h.error}"
            s["wan_lost"] = isinstance(h.error, PeerLostError)
            self.server.fail_waiting(st, s["wan_error"], lost=s["wan_lost"])
            return
        others = np.asarray(h.result, dtype=np.float32)
        inbox = s.get("inbox")
        s["inbox"] = others.copy() if inbox is None else np.add(inbox, others, out=inbox)
        if "outbox" in s:
            self._send(st)
