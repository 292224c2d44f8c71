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
from harness import wait_until

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


def logged_addresses(log_name: str, pattern: str, timeout: float = 60.0) -> list[str]:
    """Every match of ``pattern`` in the role's log, waiting for the role to write one: a worker can get here
    before a role of another tier (another DC's scheduler, the global server) has logged its address."""
    path = kvhelp.run_dir() / f"{log_name}.log"
    return wait_until(lambda: re.findall(pattern, path.read_text()) if path.exists() else [], timeout,
                      f"a line matching {pattern!r} in {path}", interval=0.1)


def logged_address(log_name: str, pattern: str) -> str:
    return logged_addresses(log_name, pattern)[0]


def local_server(dc: str) -> str:
    return logged_address(f"{dc}-scheduler", rf"local server of DC {dc} \((tcp://[^,]+),")


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
    locals_ = {dc: local_server(dc) for dc in "ab"}
    workers_b = logged_addresses("b-scheduler", r"worker \d of DC b \((tcp://[^,]+),")
    global_0 = logged_address("global-server-0", r"global server 0 ready at (tcp://\S+)")
    schedulers = [logged_address(log, r"listening on (tcp://\S+),")
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


OPS = ["init", "push", "pushpull", "pull", "cmd", "key_owner", "dc_pushpull", "reply", "table", "reject", "barrier",
       "barrier_done", "hb", "hb_ack", "bye", "shutdown", "abort", "register", "no-such-op"]


def _fuzz_value(rng: np.random.Generator, names: list[str]):
    pick = rng.integers(9)
    return [None, int(rng.integers(-3, 40)), "w", float(rng.standard_normal()), True, [1, "w"], {"w": 1},
            names[int(rng.integers(len(names)))], rng.bytes(int(rng.integers(0, 12)))][pick]


def fuzz_message(rng: np.random.Generator, names: list[str]) -> list[bytes]:
    """One random message: any op, a readable or random sender, random values under the fields servers read,
    tensors of random dtype and shape (or the key's, filled with EVIL), sometimes a header cut short."""
    fields = {name: _fuzz_value(rng, names) for name in ("req", "key", "tier", "auth", "members", "after", "name",
                                                          "args", "layout", "master", "count", "cm", "owner", "seq",
                                                          "group", "reason", "error", "info", "redirect")
              if rng.random() < 0.3}
    if rng.random() < 0.5:
        fields["key"] = "w"
    if rng.random() < 0.5:
        fields["req"] = int(rng.integers(1, 20))
    tensors = []
    for _ in range(int(rng.integers(0, 3))):
        if rng.random() < 0.6:
            tensors.append(np.full(16, EVIL, np.float32))
        else:
            dtype = ["float32", "float16", "int64", "uint8", "float64"][int(rng.integers(5))]
            tensors.append(np.full(tuple(int(n) for n in rng.integers(0, 5, size=int(rng.integers(0, 3)))), 7,
                                   dtype))
    src = names[int(rng.integers(len(names)))] if rng.random() < 0.7 else rng.bytes(6).hex()
    header = msgpack.packb({"op": OPS[int(rng.integers(len(OPS)))], "src": src, "f": fields,
                            "p": int(rng.integers(-5, 2000)),
                            "t": [[t.dtype.name, list(t.shape)] for t in tensors]})
    if rng.random() < 0.05:
        header = header[:int(rng.integers(len(header)))]
    return [header] + [t.tobytes() for t in tensors]


def fuzz(addresses: list[str], count: int, names: list[str], seed: int = 0, distinct: int = 2000) -> int:
    """``count`` random messages to each address (``distinct`` different ones, repeated: making each costs
    more than a receiver spends refusing it), senders from ``names`` or random; returns how many were sent."""
    rng = np.random.default_rng(seed)
    pool = [fuzz_message(rng, names) for _ in range(distinct)]
    s = Stranger()
    for addr in addresses:
        sock = s.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(addr)
        s.sockets[addr] = sock
    for i in range(count):
        for sock in s.sockets.values():
            sock.send_multipart(pool[i % distinct])
            s.sent += 1
    s.close()
    return s.sent
