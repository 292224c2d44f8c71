"""DC-only rounds at a local server: HFA's intra-DC averages, answered without crossing the WAN.

A worker sends ``dc_pushpull`` (``kv.pushpull(..., scope="dc")``); when every worker of the DC has sent its
n-th one for a key, each of them receives the sum of the n-th values. Workers pre-scale what they push (by
their share of the DC's samples), so the sum is the DC's weighted mean. These rounds are counted apart from
the key's ordinary rounds: they never touch the key's value, so a later pull is unaffected.
"""
from __future__ import annotations

from geomx.cluster.kvserver import KVServer, Refused, Round
from geomx.cluster.postoffice import NodeInfo
from geomx.transport.message import Message



class DCRounds:
    def __init__(self, server: KVServer) -> None:
        self.server = server
        self.counts: dict[tuple, int] = {}                       # (key, client) -> DC rounds pushed
        self.open: dict[tuple, tuple[Round, list[Message]]] = {}  # (key, n) -> (sum so far, requests held)

    def state_dict(self) -> dict:
        """The DC rounds each worker took per key; rounds still open hold requests and are not saved."""
        return {"counts": [[key, src, n] for (key, src), n in self.counts.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {(key, src): n for key, src, n in state["counts"]}

    def on_push(self, msg: Message, client: NodeInfo) -> None:
        server = self.server
        st = server.key_state(msg)
        if st.value is None:
            raise Refused(f"DC-only pushpull of key {st.key!r} before its initialization finished")
        value = server.single_tensor(msg)
        server.check_value(st, value, "DC-only pushpull")
        if client.tier_role != "worker" or client.kind == "master":
            raise Refused(f"{client.label} does not train; only workers take part in DC rounds")
        n = self.counts[(st.key, msg.src)] = self.counts.get((st.key, msg.src), 0) + 1
        if (st.key, n) not in self.open:
            self.open[(st.key, n)] = (self.server.new_round(), [])
        rnd, held = self.open[(st.key, n)]
        rnd.add(msg.src, value, msg.priority, reusable=msg.private)
        msg.tensors = []        # held until the round completes: the round has the value
        held.append(msg)
        self._complete_if_done(st, n)

    def _complete_if_done(self, st, n: int) -> None:
        rnd, held = self.open[(st.key, n)]
        if not self.server.round_complete(st, rnd, n):
            return
        del self.open[(st.key, n)]
        total = self.server.stand_in_for_departed(rnd.finish()).astype(st.dtype, copy=False)
        for request in held:
            self.server.reply(request, tensors=[total])

    def drop(self, member: str) -> None:
        """A worker left the DC: forget its held requests, complete the rounds that waited only for it."""
        for (key, n), (_, held) in list(self.open.items()):
            held[:] = [request for request in held if request.src != member]
            self._complete_if_done(self.server.keys[key], n)
