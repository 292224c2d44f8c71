"""A stranger with no secret (default settings) against what issue 18 found possible, in-process: malformed
or forged member tables and control messages, guessable ids, a reply flood, relays through the WAN emulator
to foreign DCs and addresses. The forgeries against a whole running deployment (tables, replies, aborts,
shutdowns, pushes under readable ids, training checked exact) ride on the garbage test in test_faults.py,
which launches one anyway (tests/scripts/attacker.py)."""
from __future__ import annotations

import resource
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from geomx.cluster.postoffice import Postoffice, Tier
from geomx.netem.emulator import WanEmulator
from geomx.profiles import custom_profile
from geomx.transport.message import Message, encode
from geomx.transport.refusals import RefusalLog
from geomx.transport.ids import new_node_id
from geomx.transport.van import ZmqVan, public_name
from harness import Inbox


# -- member tables are checked before they replace anything -------------------------------------------------

def _tier() -> tuple[Postoffice, Tier]:
    from geomx.config import config_from_env

    cfg = config_from_env({"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
                           "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "GEOMX_DC": "a",
                           "DMLC_NUM_ALL_WORKER": "1"})
    po = Postoffice(cfg)
    tier = po.tiers["dc:a"] = Tier(po, "dc:a", ("127.0.0.1", 1), "a", "worker", {})
    return po, tier


def _entry(node_id, rank=0, role="worker", addr="tcp://127.0.0.1:5"):
    return {"id": node_id, "kind": role, "tier_role": role, "dc": "a", "rank": rank, "addr": addr, "pid": 1}


@pytest.mark.parametrize("members", [
    "not a list",
    [_entry("someone else")],                                          # does not list this node
    [{"id": "x"}],                                                     # fields missing
    [_entry("ME"), _entry("ME", 1)],                                   # this node twice
    [_entry("ME", addr="http://evil")],                                # not a tcp address
    [_entry("ME", role="admin")],                                      # no such tier role
], ids=["not-a-list", "without-me", "incomplete", "twice", "bad-address", "bad-role"])
def test_a_malformed_table_from_the_scheduler_replaces_nothing(members):
    po, tier = _tier()
    members = members if isinstance(members, str) else [{**m, "id": po.node_id if m["id"] == "ME" else m["id"]}
                                                         for m in members]
    po._dispatch(Message("table", src="scheduler", fields={"tier": "dc:a", "auth": tier.token, "members": members}))
    assert tier.me is None and tier.members == []
    good = [_entry(po.node_id), _entry("peer", 1, addr="tcp://127.0.0.1:6")]
    po._dispatch(Message("table", src="scheduler", fields={"tier": "dc:a", "auth": tier.token, "members": good}))
    assert tier.me.id == po.node_id and len(tier.members) == 2
    # a second table, even with the token, changes nothing; without the token nothing counts at all
    po._dispatch(Message("table", src="scheduler", fields={"tier": "dc:a", "auth": tier.token, "members": good[:1]}))
    po._dispatch(Message("abort", src="scheduler", fields={"tier": "dc:a", "auth": "guess", "reason": "x"}))
    po._dispatch(Message("shutdown", src="scheduler", fields={"tier": "dc:a"}))
    assert len(tier.members) == 2 and po.aborted is None and not tier.closed
    po._dispatch(Message("shutdown", src="scheduler", fields={"tier": "dc:a", "auth": tier.token}))
    assert tier.closed
    po.metrics is not None and po.metrics.close()


def test_node_ids_are_random_and_their_public_names_hide_the_random_part():
    po, _ = _tier()
    other, _ = _tier()
    assert po.node_id != other.node_id and public_name(po.node_id) == public_name(other.node_id) == "worker-a"
    assert len(po.node_id) - len("worker-a-") == 24


def test_public_names_hide_the_random_part_of_ids_identities_and_claimed_ids():
    node_id = new_node_id("global_server-central")         # 22 characters before the random part
    assert public_name(node_id) == public_name(node_id.encode()) == "global_server-central"
    assert public_name(b"\x00k\x8b\x45\x67") == "\\x00k\\x8bEg"      # ZeroMQ's own identity for a peer without one
    assert public_name(3) == "3" and public_name("scheduler-dc:a") == "scheduler-dc:a"
    assert public_name("x" * 1000) == "x" * 64 + "..."        # a stranger's claim is shown cut short


def _random_parts(*ids: str) -> list[str]:
    return [i.rpartition("-")[2] for i in ids]


def test_refusal_and_error_lines_show_the_public_part_of_node_ids_only(caplog):
    """Node ids are capabilities that logs never show (docs/architecture.md), but a worker logged "reply to
    request 316 from 'server-a-b74c1acb6115d0e8b0928797' dropped", as did other refusal lines and error texts.
    Each place, driven in-process with ids as the deployment makes them."""
    import logging

    from geomx.cluster.client import KVClient
    from geomx.cluster.protocol import Op
    from geomx.cluster.scheduler import Scheduler
    from geomx.errors import ProtocolError
    from geomx.transport.inproc import Hub, InProcVan
    from geomx.transport.security import Sealed

    po, tier = _tier()
    server, stranger = new_node_id("server-a"), new_node_id("worker-a")
    hub = Hub()
    sched = Scheduler(tier="dc:a", dc="a", expected={"worker": 1, "server": 1}, port=0, van="inproc",
                      van_options={"hub": hub})
    van = InProcVan(node_id=stranger, dc="a", on_message=lambda m: 1 / 0, hub=hub)
    errors = []
    with caplog.at_level(logging.INFO, logger="geomx"):
        table = {"tier": "dc:a", "auth": tier.token}
        po._dispatch(Message("table", src="s", fields={**table, "members": [{**_entry(server), "weight": 0}]}))
        po._dispatch(Message("table", src="s", fields={**table, "members": [
            _entry(po.node_id), _entry(server, role="server", addr="tcp://127.0.0.1:6")]}))
        KVClient(po, tier).handle_reply(Message("reply", src=server, fields={"req": 316}))
        po._dispatch(Message("push", src=stranger))
        po._dispatch(Message("abort", src=stranger, fields={"tier": "dc:a", "auth": "guess"}))
        po.refusals.period_s = 0.01                       # a suppressed count names its peer too
        for _ in range(po.refusals.burst + 1):
            po._dispatch(Message("push", src=stranger))
        time.sleep(0.02)
        po._dispatch(Message("push", src=stranger))
        sched._on_message(Message(Op.PUSH, src=stranger))
        sched._on_message(Message(Op.HEARTBEAT, src=stranger))
        van.deliver(Message("hello", src=server))          # a handler's failure
        seal, opener = Sealed("a deployment secret 0123").sealing(server), Sealed("a deployment secret 0123")
        envelope, frame = seal.seal([b"header"], "tcp://127.0.0.1:5")
        receiver = opener.sealing(stranger)
        receiver.letter(envelope, 5).accept()
        outsider = Sealed("another secret of enough length").sealing(stranger)
        for attempt in (lambda: receiver.letter(envelope, 5),                          # replayed
                        lambda: outsider.letter(envelope, 5).open(0, frame),           # another secret
                        lambda: Message("push", src=server)["key"]):                   # a field missing
            with pytest.raises(ProtocolError) as refused:
                attempt()
            errors.append(str(refused.value))
    hub.close()
    po.metrics is not None and po.metrics.close()
    text = "\n".join([r.getMessage() for r in caplog.records] + errors)
    for line in ("reply to request 316 from 'server-a' dropped", "member entry {'id': 'server-a', ",
                 "data message 'push' from 'worker-a' dropped", "control message 'abort' (tier 'dc:a') from 'worker-a'",
                 "similar refusals from worker-a suppressed", "dc:a scheduler: unexpected 'push' from 'worker-a'",
                 "'hb' from 'worker-a' refused", "worker-a failed to handle 'hello' from server-a",
                 "a replayed message from 'server-a'", "message claiming to be from 'server-a' does not authenticate",
                 "message 'push' from 'server-a' lacks field 'key'"):
        assert line in text, (line, text)
    for random in _random_parts(po.node_id, server, stranger, sched.van.node_id):
        assert random not in text, text


def test_a_peers_zeromq_identity_is_logged_by_its_public_part_only(caplog):
    """A DEALER's identity is its node's id: the van and the WAN emulator logged its first 32 bytes, most of the
    random part, with a malformed message."""
    import logging

    sender = new_node_id("local_server-a")
    receiver = ZmqVan(node_id=new_node_id("worker-a"), dc="a", on_message=lambda m: None)
    emulator = WanEmulator(profile=custom_profile(1e9, 0.002), dcs=["a", "b"])
    receiver.start()
    emulator.start()
    ctx = zmq.Context()
    socks = []
    try:
        with caplog.at_level(logging.WARNING):
            for address in (receiver.address, emulator.address):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IDENTITY, sender.encode())
                sock.connect(address)
                sock.send_multipart([b"not a header", b"junk"])
                socks.append(sock)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and min(receiver.dropped_messages, emulator.dropped_messages) < 1:
                time.sleep(0.02)
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
        receiver.stop()
        emulator.stop()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "malformed message from peer 'local_server-a'" in text and \
        "WAN emulator dropped a message from 'local_server-a'" in text, text
    assert not any(random in text for random in _random_parts(sender, receiver.node_id)), text


# -- a flood is bounded in memory and in log lines ----------------------------------------------------------

def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_a_reply_flood_grows_the_receiver_by_less_than_100_mib_and_logs_a_few_lines():
    """5,000 forged 128 KiB replies (625 MiB) sent as fast as the socket takes them, at a receiver that
    refuses each (a dict lookup and a rate-limited log, as KVClient does) but whose receive thread is held
    up meanwhile (as by a busy handler). The receive queue is bounded per peer, so the flood waits in the
    sender's buffers, not the receiver's memory. Measured over 2 runs each on a loaded 2-core host: unbounded
    (the old RCVHWM=0) the receiver took 1,712-1,752 replies in 3 s and grew by 237-242 MiB; bounded it took
    about 300 and grew by 37 MiB."""
    import logging

    quiet = logging.getLogger("test.flood")
    quiet.propagate = False            # the lines are counted by the RefusalLog, not printed
    refused = RefusalLog(quiet)
    pending: dict = {}
    gate = threading.Event()

    def refuse(msg: Message) -> None:
        gate.wait(20)
        if pending.get(msg.get("req")) is None:
            refused.note(msg.src, "reply %r from %r dropped", msg.get("req"), msg.src)

    receiver = ZmqVan(node_id="victim", dc="a", on_message=refuse)
    receiver.start()
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.SNDHWM, 16)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(receiver.address)
    frames = [bytes(f) for f in encode(Message("reply", src="server-a", fields={"req": 1},
                                               tensors=[np.ones(32768, np.float32)]))]
    try:
        before = _rss_mib()
        sent, end = 0, time.monotonic() + 3.0
        while sent < 5_000 and time.monotonic() < end:
            try:
                flood.send_multipart(frames, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:                      # back-pressure: the receiver takes no more for now
                time.sleep(0.002)
        time.sleep(0.5)                            # what is in flight lands
        grown = _rss_mib() - before
        gate.set()
        deadline = time.monotonic() + 30
        while refused.total < sent and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gate.set()
        flood.close()
        ctx.term()
        receiver.stop()
    assert grown < 100, f"the receiver grew by {grown:.0f} MiB holding {sent} forged replies"
    assert refused.total == sent and refused.lines <= 10 + 3      # a burst, then one line per 10 s


def test_a_message_the_receiver_cannot_decode_leaves_its_receive_thread_serving():
    """A header announcing a 65-dimensional tensor made numpy raise a ValueError no receive loop caught: the
    thread died, the node went deaf and its tier dropped it as dead (found by a review). Such specs, and
    empty shapes numpy cannot hold, are refused as malformed; whatever else a message raises is logged and the
    loop goes on."""
    got: list[str] = []
    receiver = ZmqVan(node_id="victim", dc="a", on_message=lambda m: got.append(m.op))
    receiver.start()
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(receiver.address)
    try:
        for spec, frame in ((["float32", [1] * 65], b"\0" * 4), (["float32", [0, 2 ** 62]], b""),
                            (["float32", [0, 2 ** 62, 2 ** 62]], b"")):
            peer.send_multipart([msgpack.packb({"op": "evil", "src": "x", "f": {}, "t": [spec]}), frame])
            peer.send_multipart([msgpack.packb({"op": "ping", "src": "x", "f": {}, "t": []})])
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == ["ping"] * 3 and receiver.dropped_messages == 3
        assert receiver._receive_thread.is_alive()
    finally:
        peer.close()
        ctx.term()
        receiver.stop()


# -- the WAN emulator relays only within its configuration ---------------------------------------------------

def test_the_emulator_relays_only_between_its_dcs_and_to_its_hosts():
    emulator = WanEmulator(profile=custom_profile(1e9, 0.002), dcs=["central", "a", "b"])
    emulator.start()
    inbox = Inbox()
    dst = ZmqVan(node_id="dst", dc="b", on_message=inbox)
    dst.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(emulator.address)

    def relay(dst_addr, src_dc, dst_dc, tag):
        route = msgpack.packb({"dst": dst_addr, "src_dc": src_dc, "dst_dc": dst_dc, "prio": 0})
        frames = encode(Message("hello", src=tag))
        sock.send_multipart([route, *frames])

    try:
        for i in range(2000):                                       # claimed DC names: no link, no thread each
            relay(dst.address, f"dc{i}", "b", "unknown-dc")
        relay(dst.address.replace("127.0.0.1", "192.0.2.1"), "a", "b", "foreign-host")   # a third party
        relay(emulator.address, "a", "b", "loop")                                      # itself
        relay(dst.address, "a", "b", "ok")
        assert inbox.wait_for(1)
        time.sleep(0.3)
        assert [m.src for m in inbox.messages] == ["ok"]
        assert list(emulator.stats()["links"]) == ["a->b"]
        assert emulator.dropped_messages == 2002
        assert threading.active_count() < 30
    finally:
        sock.close()
        dst.stop()
        emulator.stop()


def test_a_stranger_connecting_first_under_the_emulators_name_cannot_keep_its_deliveries_off_a_node():
    """The emulator's sockets introduced themselves under one constant identity: a stranger who connected to a
    node first under it was kept, the emulator's own connection refused, and every message relayed to that
    node was lost silently (found by a review). Each emulator's identity now has a random part."""
    em = WanEmulator(profile=custom_profile(1e9, 0.002), dcs=["a", "b"])
    em.start()
    got = Inbox()
    b = ZmqVan(node_id="server-b-" + "1" * 24, dc="b", on_message=got)
    a = ZmqVan(node_id="worker-a-" + "2" * 24, dc="a", on_message=lambda m: None, emulator=em.address)
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    try:
        b.start()
        a.start()
        assert em.identity.startswith(b"geomx-wan-emulator-") and em.identity != b"geomx-wan-emulator"
        stranger.setsockopt(zmq.IDENTITY, b"geomx-wan-emulator")
        stranger.connect(b.address)
        stranger.send(b"\x81\xa2op")        # the connection is up, and b holds that identity
        time.sleep(0.3)
        a.send(b.address, Message("through the emulator"), dst_dc="b")
        assert got.wait_for(1, 10) and [m.op for m in got.messages] == ["through the emulator"]
    finally:
        stranger.close()
        ctx.term()
        for thing in (a, b, em):
            thing.stop()


def test_the_launcher_tells_the_emulator_its_dcs_and_host(tmp_path):
    from geomx.cli.launch import plan
    from geomx.cli.topology import load_topology

    topo = load_topology(workers_per_dc=1, wan="regional")
    spec = next(s for s in plan(topo, ["x"], tmp_path) if s.kind == "emulator")
    assert spec.env["GEOMX_EMULATOR_DCS"] == "central,a,b" and spec.env["GEOMX_EMULATOR_HOSTS"] == topo.host


def test_a_server_still_waiting_for_its_member_table_holds_at_most_256_mib_of_early_requests():
    """Requests that overtake a server's member table are held for it, but a stranger cannot fill a starting
    server's memory that way: past 256 MiB of tensors (or 10,000 messages) they are dropped and logged."""
    import logging
    from types import SimpleNamespace

    from geomx.cluster.kvserver import KVServer

    po = SimpleNamespace(metrics_fields=[], refusals=RefusalLog(logging.getLogger("test")),
                         cfg=SimpleNamespace(label="server of DC a"), add_periodic_check=lambda check: None)
    server = KVServer(po)
    big = np.broadcast_to(np.zeros(1, np.uint8), (64 << 20,))          # 64 MiB as far as nbytes goes, no memory
    for _ in range(6):
        server.handle(Message("push", src="stranger", fields={"key": 1}, tensors=[big]))
    server.handle(Message("pull", src="stranger", fields={"key": 1}))       # no tensor: still held
    assert [m.op for m in server._early] == ["push"] * 4 + ["pull"]
    assert server.queue_depths()["held_requests"] == 5
