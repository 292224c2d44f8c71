"""GeoMX's HFA server logic at a local server, for scripts that run HFA through the raw KVStore (GeoMX's
``examples/cnn_hfa.py``: ``MXNET_KVSTORE_USE_HFA=1``, workers push ``w / n_local`` every K1 local steps and pull
the result into their parameters).

Per key, every complete round of the DC is the DC's average model (the workers pre-scale). Of each K2 such
rounds, the first K2 - 1 answer the DC at once; the K2-th sends ``(average - milestone) / G`` (G DCs) across the
WAN, where the global servers sum the DCs' shares (the sum reduction), and ``milestone + that mean change`` becomes
both the DC's answer and the next milestone: every DC then holds the same global average.

GeoMX's defects fixed here (../shared/reference/geomx_spec.md, section 9): the milestone starts from the master
worker's initial value (GeoMX took each DC's first push, so DCs started apart); rounds are counted per key (GeoMX
counted key 0's and assumed every key is pushed in every round).

``DistributedOptimizer(sync="hfa")`` runs HFA on the workers instead (geomx.sync.hfa), over DC-only rounds; this
module serves only scripts that push models through the raw KVStore.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from geomx.cluster.kvserver import KeyState, Round
from geomx.cluster.round_policies import register_round_policy
from geomx.errors import PeerLostError
from geomx.sync.settings import settings_from_env


@dataclass
class HfaKeyState:
    """A key's HFA rounds at a local server. Results are applied in round order: a DC round that completes
    while a global average is on its way (a script that pushes again without pulling) waits for it."""
    rounds: int = 0                          # DC rounds completed
    applied: int = 0                         # DC rounds whose result is the key's value
    milestone: np.ndarray | None = None      # the last global average (the initial value before the first)
    in_flight: bool = False                  # a global average was sent and is not yet answered
    done: dict[int, tuple[np.ndarray, list[str], bool]] = field(default_factory=dict)   # (value, who, global)

    def state_dict(self) -> dict:
        return {"rounds": self.rounds, "applied": self.applied, "milestone": self.milestone,
                "in_flight": self.in_flight,
                "done": {n: {"value": v, "contributors": list(c), "global": g} for n, (v, c, g) in self.done.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rounds, self.applied, self.in_flight = int(state["rounds"]), int(state["applied"]), state["in_flight"]
        self.milestone = None if state["milestone"] is None else np.array(state["milestone"])
        self.done = {int(n): (np.array(d["value"]), list(d["contributors"]), bool(d["global"]))
                     for n, d in state["done"].items()}


@register_round_policy("hfa")
class HfaServerRounds:
    """The local server's HFA round policy (see the module docstring). K2: GeoMX reads
    ``MXNET_KVSTORE_HFA_K2`` on the local servers, so this process's own variable counts where it asks for HFA;
    otherwise the master worker's, which comes with the global servers' configuration (``info["hfa_k2"]``)."""

    def __init__(self, server, env=None) -> None:
        self.server = server     # the LocalServer: set_value, fail_waiting, upstream, global_tier, info
        own = settings_from_env(env)
        self._own_k2 = own.k2 if own.algorithm == "hfa" else None

    @property
    def k2(self) -> int:
        return self._own_k2 or int(self.server.info["hfa_k2"])

    def on_round(self, st: KeyState, number: int, rnd: Round) -> None:
        hfa = st.hfa
        if hfa is None:
            hfa = st.hfa = HfaKeyState(milestone=np.array(st.value))
        hfa.rounds += 1
        average = rnd.total.astype(st.dtype, copy=False)
        if hfa.rounds % self.k2 or hfa.in_flight:
            # an intra-DC average (with a global one still on its way it stays local too: its change reaches
            # the other DCs with the next global average)
            hfa.done[hfa.rounds] = (average, rnd.contributors, False)
            self._apply_in_order(st)
            return
        dcs = len(self.server.global_tier.workers())
        change = ((average.astype(np.float32) - hfa.milestone) / np.float32(dcs)).astype(st.dtype)
        hfa.in_flight = True
        this, contributors = hfa.rounds, rnd.contributors
        h = self.server.upstream.pushpull(st.key, change, priority=rnd.priority, count=1)
        h.add_done_callback(lambda h: self._global_done(st, this, contributors, h))

    def _global_done(self, st: KeyState, number: int, contributors: list[str], h) -> None:
        hfa = st.hfa
        hfa.in_flight = False
        if h.error is not None:
            self.server.fail_waiting(st, f"the global average of key {st.key!r} (DC round {number}) failed: "
                                         f"{h.error}", lost=isinstance(h.error, PeerLostError))
            return
        # the milestone cannot have moved since the change was sent: only this reply moves it
        hfa.done[number] = ((hfa.milestone + h.result).astype(st.dtype), contributors, True)
        self._apply_in_order(st)

    def _apply_in_order(self, st: KeyState) -> None:
        hfa = st.hfa
        while hfa.applied + 1 in hfa.done:
            hfa.applied += 1
            value, contributors, is_global = hfa.done.pop(hfa.applied)
            if is_global:
                hfa.milestone = value
            self.server.set_value(st, value, contributors)
