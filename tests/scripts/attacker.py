"""What a stranger on the same host can send a running deployment without its secret (issue 18), for the
training scripts the fault tests launch: forged member tables, barrier releases, heartbeat acks, shutdowns
and aborts under every name it can read or guess, a reply for every likely request id, and pushes under the
ids the run directory shows. Nothing here knows a real node id: the ids are random and never written out.
"""
from __future__ import annotations

import json
import re
import time

import msgpack
import numpy as np
import zmq

import kvhelp

EVIL = 666.0
ABORT_TEXT = "ATTACKER ABORT"


class Stranger:
    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.sockets: dict[str, zmq.Socket] = {}
        self.sent = 0

    def send(self, addr: str, op: str, src: str, fields: dict, tensors=()) -> None:
        sock = self.sockets.get(addr)
        if sock is None:
            sock = self.sockets[addr] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(addr)
        header = {"op": op, "src": src, "f": fields, "t": [[t.dtype.name, list(t.shape)] for t in tensors]}
        sock.send_multipart([msgpack.packb(header)] + [t.tobytes() for t in tensors])
        self.sent += 1

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()


def _address(log_name: str, pattern: str) -> list[str]:
    return re.findall(pattern, (kvhelp.run_dir() / f"{log_name}.log").read_text())


def readable_names() -> list[str]:
    """The node names anyone who can read the run directory learns (metrics files), plus the guessable
    names of the schedulers before ids were random."""
    time.sleep(1.2)                     # metrics files are written every second
    names = {json.loads(line).get("node") for f in (kvhelp.run_dir() / "metrics").glob("*.jsonl")
             for line in f.read_text().splitlines()}
    return sorted(n for n in names if n) + ["scheduler-global", "scheduler-dc:a", "scheduler-dc:b"]


def attack(shape, max_request: int) -> dict:
    """Forge everything at every node whose address the logs show; returns what was sent."""
    evil = np.full(shape, EVIL, np.float32)
    locals_ = {dc: _address(f"{dc}-scheduler", rf"local server of DC {dc} \((tcp://[^,]+),")[0] for dc in "ab"}
    workers_b = _address("b-scheduler", r"worker \d of DC b \((tcp://[^,]+),")
    global_0 = _address("global-server-0", r"global server 0 ready at (tcp://\S+)")[0]
    schedulers = [_address(log, r"listening on (tcp://\S+),")[0]
                  for log in ("global-scheduler", "central-scheduler", "a-scheduler", "b-scheduler")]
    names = readable_names()
    bogus = [{"id": "intruder", "kind": "worker", "tier_role": "worker", "dc": "a", "rank": 0,
              "addr": "tcp://127.0.0.1:9", "pid": 1}]
    targets = {locals_["a"]: ("dc:a", "global"), locals_["b"]: ("dc:b", "global"), global_0: ("global", "dc:central"),
               **{w: ("dc:b",) for w in workers_b}}
    s = Stranger()
    for addr, tiers in targets.items():
        for tier in tiers:
            for src in names:
                s.send(addr, "table", src, {"tier": tier, "members": bogus})
                s.send(addr, "barrier_done", src, {"tier": tier, "seq": 1})
                s.send(addr, "hb_ack", src, {"tier": tier})
                s.send(addr, "shutdown", src, {"tier": tier})
                s.send(addr, "abort", src, {"tier": tier, "reason": ABORT_TEXT})
            s.send(addr, "abort", "scheduler-" + tier, {"reason": ABORT_TEXT})
    for addr in schedulers:
        for src in names:
            for op in ("bye", "barrier", "abort"):
                s.send(addr, op, src, {"tier": "dc:a", "group": "worker", "seq": 1, "reason": ABORT_TEXT})
    # a reply for every request id a worker or a local server has used or will use soon, under every name
    for addr in (*workers_b, *locals_.values()):
        for req in range(1, max_request + 1):
            for src in names:
                s.send(addr, "reply", src, {"req": req}, [evil])
    # pushes under every id the run directory shows
    for addr in (*locals_.values(), global_0):
        for src in names:
            s.send(addr, "pushpull", src, {"req": 1, "key": "w"}, [evil])
            s.send(addr, "push", src, {"req": 2, "key": "w"}, [evil])
    time.sleep(0.3)
    s.close()
    return {"names": names, "targets": sorted(targets), "messages": s.sent}
