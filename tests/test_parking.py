"""Payloads that skip the WAN emulator (geomx.transport.parking): a large message to a node on the same host goes
straight to its receiver, which holds it until the emulator, handed only its route and size, releases it at the
time the link model gives. The receiver sees what it saw before, when it saw it; the emulator counts the same
bytes; only the copies through its process are gone. Real vans and a real emulator over 127.0.0.1, the routes
and releases over the same-host channel (geomx.transport.park_channel) or, where it cannot open, over ZeroMQ."""
from __future__ import annotations

import contextlib
import os
import socket
import time

import numpy as np
import pytest

from geomx.errors import ConfigError
from geomx.netem import WanEmulator
from geomx.profiles import CENTRAL_DC, custom_profile
from geomx.transport import park_channel, parking
from geomx.transport.message import Message, encode, payload_nbytes
from geomx.transport.security import Sealed
from geomx.transport.van import PARK_MIN_BYTES, ZmqVan
from harness import TimedInbox, wait_until

BIG = 250_000           # float32 elements: 1 MB, parked
SMALL = 16              # relayed


@pytest.fixture(params=["channel", "zeromq"])
def deployment(request, monkeypatch):
    """An emulator and vans made by the test, stopped at teardown; parked messages' routes and releases over the
    same-host channel, or over ZeroMQ where it is not available."""
    over_channel = request.param == "channel"
    if not over_channel:
        monkeypatch.setattr(park_channel, "available", lambda: False)
    made: list = []

    def make(rate_bps=1e8, rtt_s=0.04, security=None, max_frame_bytes=-1):
        em = WanEmulator(profile=custom_profile(rate_bps, rtt_s), security=security, max_frame_bytes=max_frame_bytes)
        em.start()
        inbox = TimedInbox()
        sender = ZmqVan(node_id="a-server", dc="a", on_message=lambda m: None, emulator=em.address,
                        emulator_bypass=True, security=security)
        receiver = ZmqVan(node_id="global-server", dc=CENTRAL_DC, on_message=inbox, emulator=em.address,
                          emulator_bypass=True, security=security)
        made.extend([sender, receiver, em])
        sender.start()
        receiver.start()
        assert (sender._channel is not None and receiver._channel is not None) == over_channel
        return em, sender, receiver, inbox

    make.over_channel = over_channel
    yield make
    for thing in made:
        thing.stop()


def test_a_parked_message_arrives_when_the_link_model_says_and_only_its_route_crosses_the_emulator(deployment):
    """100 Mbit/s, 20 ms one way: 1 MB takes 80 ms on the line, so it arrives after 100 ms, whole; the emulator
    counted its bytes on the link (as many as the sender handed to ZeroMQ) without receiving them."""
    em, a, c, inbox = deployment()
    value = np.arange(BIG, dtype=np.float32)
    t0 = time.monotonic()
    a.send(c.address, Message("push", fields={"k": 1}, tensors=[value]), dst_dc=CENTRAL_DC)
    (t, msg), = inbox.wait_for(1)
    assert msg.op == "push" and msg.src == "a-server" and msg["k"] == 1 and np.array_equal(msg.tensors[0], value)
    assert t - t0 >= 0.100 - 0.002                      # never early
    # the emulator counts a delivery right after handing its release over
    wait_until(lambda: em.stats()["links"]["a->central"]["messages"], 5, "the emulator's count")
    stats = em.stats()
    assert stats["parked_messages"] == 1
    assert stats["links"]["a->central"]["bytes"] == a.sent_bytes[CENTRAL_DC] == payload_nbytes(
        encode(Message("push", src="a-server", fields={"k": 1}, tensors=[value])))
    assert len(c._parking) == 0 and c._parking.held_bytes == 0


def test_small_messages_keep_their_order_with_parked_ones_on_the_link(deployment):
    """A small message sent after a big one crosses the same link behind it (FIFO at equal priority); a
    high-priority one overtakes the big one at a chunk boundary, parked or not. Over ZeroMQ the small ones are
    relayed (one socket from the emulator keeps the order); with the same-host channel they are parked too
    (one channel keeps it), and no route crosses ZeroMQ."""
    # a line slow enough that the urgent one, sent 30 ms later, still finds the big one on it under load (at
    # 160 ms a stall of the emulator's process over ~130 ms would have let the big one through whole)
    em, a, c, inbox = deployment(rate_bps=1e7)
    a.send(c.address, Message("big", tensors=[np.zeros(BIG, np.float32)]), dst_dc=CENTRAL_DC)     # 800 ms
    a.send(c.address, Message("after", tensors=[np.zeros(SMALL, np.float32)]), dst_dc=CENTRAL_DC)
    time.sleep(0.03)
    urgent = Message("urgent", tensors=[np.zeros(SMALL, np.float32)])
    urgent.priority = 5
    a.send(c.address, urgent, dst_dc=CENTRAL_DC)
    got = inbox.wait_for(3)
    assert [m.op for _, m in got] == ["urgent", "big", "after"]
    assert PARK_MIN_BYTES > SMALL * 4
    assert em.stats()["parked_messages"] == (3 if deployment.over_channel else 1)
    assert (em.address in a._sockets) != deployment.over_channel     # the route's ZeroMQ socket, never made


def test_sealed_messages_are_parked_and_opened_as_ever(deployment):
    secret = "s" * 32
    em, a, c, inbox = deployment(security=Sealed(secret))
    value = np.random.default_rng(0).standard_normal(BIG).astype(np.float32)
    a.send(c.address, Message("push", tensors=[value]), dst_dc=CENTRAL_DC)
    (_, msg), = inbox.wait_for(1)
    assert np.array_equal(msg.tensors[0], value) and em.stats()["parked_messages"] == 1


def test_many_parked_messages_on_a_fast_link_all_arrive_once_in_order(deployment):
    """A link too fast to matter: a release may reach the receiver before its payload; every message still
    arrives exactly once, in the order sent."""
    em, a, c, inbox = deployment(rate_bps=1e11, rtt_s=0.0)
    for i in range(60):
        a.send(c.address, Message("push", fields={"i": i}, tensors=[np.full(BIG // 4, i, np.float32)]),
               dst_dc=CENTRAL_DC)
    got = inbox.wait_for(60)
    assert [m["i"] for _, m in got] == list(range(60))
    assert all(float(m.tensors[0][0]) == m["i"] for _, m in got)
    assert em.stats()["parked_messages"] == 60 and len(c._parking) == 0


def test_the_parking_store_matches_either_order_and_drops_what_is_never_matched():
    store = parking.Parking(max_age_s=0.2, max_entries=10, max_bytes=1000)
    assert store.park(b"x" * 12, "m1", 10) is None and store.release(b"x" * 12) == "m1"      # payload first
    assert store.release(b"y" * 12) is None and store.park(b"y" * 12, "m2", 10) == "m2"       # release first
    assert store.park(b"z" * 12, "m3", 10) is None and store.held_bytes == 10
    time.sleep(0.25)
    assert store.release(b"w" * 12) is None and store.dropped == 1 and store.held_bytes == 0  # m3 too old
    for i in range(3):
        store.park(bytes([i]) * 12, f"big{i}", 400)
    assert len(store) == 2 and store.held_bytes == 800 and store.dropped == 2     # past 1000 bytes: the oldest
    assert parking.read_marker(parking.marker(parking.PARK, b"i" * 12)) == (parking.PARK, b"i" * 12)
    assert parking.read_marker(b"\x81\xa2op") is None and parking.read_marker(b"\x01" + b"e" * 13) is None


def test_a_parked_message_is_held_as_long_as_a_request_may_wait_and_a_drop_names_the_limit(monkeypatch, caplog):
    """Held for 300 s at most, a message behind a long WAN backlog (a slow link, a large model) was dropped
    while the emulator would still release it, and its round waited out GEOMX_TIMEOUT (found by a review). It is
    held as long as a request may wait (GEOMX_TIMEOUT, at least 300 s), and a drop says which limit to raise."""
    monkeypatch.setenv("GEOMX_TIMEOUT", "3600")
    assert parking.Parking().max_age_s == 3600
    monkeypatch.setenv("GEOMX_TIMEOUT", "30")
    assert parking.Parking().max_age_s == parking.MAX_AGE_S
    store = parking.Parking(max_bytes=1000)
    with caplog.at_level("ERROR", logger="geomx.van"):
        store.park(b"a" * 12, "m1", 600)
        store.park(b"b" * 12, "m2", 600)
    assert store.dropped == 1 and "more than 0 MiB waited (GEOMX_PARK_MB)" in caplog.text, caplog.text


def test_a_bad_park_cap_is_named(monkeypatch):
    monkeypatch.setenv("GEOMX_PARK_MB", "lots")
    with pytest.raises(ConfigError, match="GEOMX_PARK_MB"):
        parking.Parking()


def test_the_emulator_drops_a_malformed_parked_route_and_keeps_forwarding(deployment):
    import msgpack
    import zmq

    em, a, c, inbox = deployment(max_frame_bytes=16 << 20)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(em.address)
    try:
        base = {"dst": c.address, "src_dc": "a", "dst_dc": CENTRAL_DC, "prio": 0}
        # the last: more than a part can be (four frames of the limit), which had held the link for a day
        for bad in ({"park": b"short", "n": 10}, {"park": b"i" * 12, "n": -1}, {"park": b"i" * 12},
                    {"park": b"i" * 12, "n": (64 << 20) + 1}):
            sock.send_multipart([msgpack.packb({**base, **bad}, use_bin_type=True)])
        sock.send_multipart([msgpack.packb({**base, "park": b"i" * 12, "n": 5}, use_bin_type=True), b"extra"])
        wait_until(lambda: em.dropped_messages >= 5, 5, "five dropped routes")
        assert em.dropped_messages == 5 and em.stats()["parked_messages"] == 0
        a.send(c.address, Message("push", tensors=[np.zeros(BIG, np.float32)]), dst_dc=CENTRAL_DC)
        inbox.wait_for(1)
    finally:
        sock.close()


def test_a_van_started_before_the_emulator_keeps_zeromq_and_its_messages_their_order():
    """The path is chosen once, when a van starts. A van that started before the emulator (its messages waiting
    in ZeroMQ's queue) and switched to the channel once it appeared had its later messages overtake the earlier
    ones (found by a review: 8 trials of 8). ``geomx launch`` and the benchmark start the roles once the emulator
    listens on its channel (``wait_for_channel``)."""
    from geomx.bench.common import free_port

    port = free_port()
    inbox = TimedInbox()
    address = f"tcp://127.0.0.1:{port}"
    a = ZmqVan(node_id="a-server", dc="a", on_message=lambda m: None, emulator=address, emulator_bypass=True)
    c = ZmqVan(node_id="global-server", dc=CENTRAL_DC, on_message=inbox, emulator=address, emulator_bypass=True)
    em = WanEmulator(profile=custom_profile(1e9, 0.0), port=port)
    try:
        a.start()
        c.start()
        assert not park_channel.wait_for_channel(address, timeout_s=0.3)        # nothing listens yet
        for i in range(5):
            a.send(c.address, Message("before", fields={"i": i}, tensors=[np.zeros(SMALL, np.float32)]),
                   dst_dc=CENTRAL_DC)
        em.start()
        assert park_channel.wait_for_channel(address, timeout_s=5)
        for i in range(5, 10):
            a.send(c.address, Message("after", fields={"i": i}, tensors=[np.zeros(SMALL, np.float32)]),
                   dst_dc=CENTRAL_DC)
        got = inbox.wait_for(10)
        assert [m["i"] for _, m in got] == list(range(10))
        assert not a.same_host_channel and not c.same_host_channel and em.stats()["parked_messages"] == 0
    finally:
        for thing in (a, c, em):
            thing.stop()


def test_a_van_never_hangs_on_a_channel_name_someone_else_holds():
    """A listener under the emulator's name whose queue is full (another user squatting it) made a blocking
    connect wait forever, and every van's start with it (found by a review). The connect does not block, and
    a listener that does not answer the hello gets no channel."""
    address = "tcp://127.0.0.1:5"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fillers = []
    try:
        squatter.bind(park_channel.channel_name(address))
        squatter.listen(0)
        for _ in range(4):          # whatever its queue takes; the next connect would block
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            filler.setblocking(False)
            fillers.append(filler)
            try:
                filler.connect(park_channel.channel_name(address))
            except BlockingIOError:
                break
        t0 = time.monotonic()
        assert park_channel.VanChannel.connect(address, "tcp://127.0.0.1:9", wait_s=0.3) is None
        assert time.monotonic() - t0 < 2.0
    finally:
        for sock in (squatter, *fillers):
            sock.close()


def test_a_van_whose_emulator_restarted_goes_back_to_zeromq_and_relays_small_messages_again():
    """The emulator closed the channel (it stopped): the van sends its routes over ZeroMQ from then on, and
    parks only what it parked without the channel (small messages are relayed again)."""
    from geomx.bench.common import free_port

    port = free_port()
    inbox = TimedInbox()
    first = WanEmulator(profile=custom_profile(1e9, 0.0), port=port)
    first.start()
    a = ZmqVan(node_id="a-server", dc="a", on_message=lambda m: None, emulator=first.address, emulator_bypass=True)
    c = ZmqVan(node_id="global-server", dc=CENTRAL_DC, on_message=inbox, emulator=first.address,
               emulator_bypass=True)
    second = WanEmulator(profile=custom_profile(1e9, 0.0), port=port)
    try:
        a.start()
        c.start()
        assert a.same_host_channel and c.same_host_channel
        first.stop()
        wait_until(lambda: not a.same_host_channel and not c.same_host_channel, 5, "the vans seeing it closed")
        second.start()
        a.send(c.address, Message("small", tensors=[np.zeros(SMALL, np.float32)]), dst_dc=CENTRAL_DC)
        a.send(c.address, Message("big", tensors=[np.zeros(BIG, np.float32)]), dst_dc=CENTRAL_DC)
        got = inbox.wait_for(2)
        assert [m.op for _, m in got] == ["small", "big"] and second.stats()["parked_messages"] == 1
    finally:
        for thing in (a, c, second):
            thing.stop()


def test_a_channel_end_of_another_user_is_refused_and_routes_go_over_zeromq(monkeypatch, caplog):
    """An abstract Unix name has no file mode: any process could listen under it first, or connect and claim a
    van's releases. Each end checks the other's user id; against another user's the van uses ZeroMQ."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with left, right:
        assert park_channel.same_user(left)
        monkeypatch.setattr(park_channel.os, "getuid", lambda: 4242)
        assert not park_channel.same_user(left)
    em = WanEmulator(profile=custom_profile(1e9, 0.0))
    em.start()
    inbox = TimedInbox()
    a = ZmqVan(node_id="a-server", dc="a", on_message=lambda m: None, emulator=em.address, emulator_bypass=True)
    c = ZmqVan(node_id="global-server", dc=CENTRAL_DC, on_message=inbox, emulator=em.address)
    try:
        with caplog.at_level("WARNING", logger="geomx.van"):
            assert park_channel.VanChannel.connect(em.address, "tcp://127.0.0.1:9") is None
        assert "belongs to another user" in caplog.text
        a.start()
        c.start()
        a.send(c.address, Message("push", tensors=[np.ones(BIG, np.float32)]), dst_dc=CENTRAL_DC)
        inbox.wait_for(1)
        assert a._channel is None and em.address in a._sockets and em.stats()["parked_messages"] == 1
    finally:
        for thing in (a, c, em):
            thing.stop()


def test_the_emulator_refuses_a_van_of_another_user_and_that_van_uses_zeromq(monkeypatch, caplog):
    """The emulator's end checks the van's user id too: another user's process cannot claim releases or forge
    routes over the channel. Its connection is closed before the answer to its hello, so it has no channel."""
    em = WanEmulator(profile=custom_profile(1e9, 0.0))
    em.start()
    # the emulator's accepted socket carries the channel's name, the van's none: only the emulator sees a stranger
    monkeypatch.setattr(park_channel, "same_user", lambda sock: not sock.getsockname())
    try:
        with caplog.at_level("WARNING", logger="geomx.van"):
            assert park_channel.VanChannel.connect(em.address, "tcp://127.0.0.1:9") is None
        assert "refused a same-host channel: another user's process" in caplog.text
    finally:
        em.stop()


def test_out_of_files_the_channel_listener_rests_instead_of_spinning():
    """Out of file descriptors, accept fails and the connection stays queued: a listener still polled would wake
    the emulator's loop at once, every time (116,707 log lines in 2 s, found by a review). It rests, unpolled,
    and takes the van once files are free again."""
    import resource

    import zmq

    address = "tcp://127.0.0.1:8"           # only names the channel
    channel = park_channel.EmulatorChannel.open(address)
    poller = zmq.Poller()
    channel.attach(poller)
    van = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    van.setblocking(False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        van.connect(park_channel.channel_name(address))
        (fd, events), = poller.poll(1000)
        assert channel.ready(fd, events) == [] and channel.waiting      # accept failed: the listener rests
        assert poller.poll(50) == [] and not channel._connections       # unpolled, though the van still waits
        for filler in fillers:
            os.close(filler)
        fillers = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert channel.service(time.monotonic() + park_channel.PAUSE_S) == float("inf") and not channel.waiting
        (fd, events), = poller.poll(1000)
        channel.ready(fd, events)
        assert len(channel._connections) == 1                           # taken after the rest
    finally:
        for filler in fillers:
            os.close(filler)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        van.close()
        channel.close()


def test_waiting_for_the_channel_ends_once_the_emulator_answers_without_one():
    """An emulator that listens on TCP but could not open its channel (or an older one) opens none later: the
    launcher stops waiting at once instead of after its 30 s."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        t0 = time.monotonic()
        assert not park_channel.wait_for_channel(f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout_s=30)
        assert time.monotonic() - t0 < 5
    finally:
        listener.close()


def test_releases_a_van_has_no_room_for_wait_in_order_and_go_in_packets_its_buffer_takes():
    """The emulator never blocks on a van: releases its buffer cannot take wait, in order, and go once it reads
    (the loop polls the connection for room, not every millisecond). A packet larger than the emulator's send
    buffer (EMSGSIZE) goes in halves: it had been taken for a van gone, and the van cut off (found by a review)."""
    import msgpack
    import zmq

    address = "tcp://127.0.0.1:7"       # only names the channel: nothing listens there
    channel = park_channel.EmulatorChannel.open(address)
    poller = zmq.Poller()
    channel.attach(poller)
    van = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        van.connect(park_channel.channel_name(address))
        van.sendall(msgpack.packb({"addr": "tcp://127.0.0.1:9"}))
        van.sendall(b"route")
        routes = []
        deadline = time.monotonic() + 5
        while not routes and time.monotonic() < deadline:      # the connection, then its packets
            for fd, events in poller.poll(1000):
                routes += channel.ready(fd, events)
        assert routes == [("tcp://127.0.0.1:9", b"route")]
        van.settimeout(5)
        assert van.recv(64) == park_channel.ACK         # the emulator took the hello
        conn, = channel._connections.values()
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)      # smaller than a full packet
        marks = [parking.marker(parking.RELEASE, i.to_bytes(12, "big")) for i in range(100_000)]
        assert channel.release("tcp://127.0.0.1:9", marks[:80_000]) and channel.backlogged    # more than it takes
        assert poller.poll(0) == []                     # no room yet, nothing to read: the loop may sleep
        for at in range(80_000, 100_000, 10):       # more while they wait: behind them
            assert channel.release("tcp://127.0.0.1:9", marks[at:at + 10])
        assert not channel.release("tcp://127.0.0.1:10", marks[:1])                # no channel: over ZeroMQ
        got = []
        while len(got) < len(marks):
            packet = van.recv(park_channel.MAX_PACKET)
            got += [packet[at:at + parking.MARKER_BYTES] for at in range(0, len(packet), parking.MARKER_BYTES)]
            for fd, events in poller.poll(0):
                channel.ready(fd, events)
        assert got == marks and not channel.backlogged and channel._by_address
    finally:
        van.close()
        channel.close()


@pytest.mark.parametrize("deployment", ["channel"], indirect=True)
def test_the_emulator_drops_a_bad_route_on_the_channel_and_keeps_forwarding(deployment):
    """A route that is not msgpack, or not a parked message's, or a bad one, is dropped; the channel goes on."""
    import msgpack

    em, a, c, inbox = deployment()
    van = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        van.connect(park_channel.channel_name(em.address))
        van.sendall(msgpack.packb({"addr": "tcp://127.0.0.1:9"}))
        base = {"dst": c.address, "src_dc": "a", "dst_dc": CENTRAL_DC, "prio": 0}
        for bad in (b"\xc1not msgpack", msgpack.packb(base), msgpack.packb({**base, "park": b"i" * 12, "n": -1})):
            van.sendall(bad)
        wait_until(lambda: em.dropped_messages >= 3, 5, "three dropped routes")
        a.send(c.address, Message("push", tensors=[np.zeros(BIG, np.float32)]), dst_dc=CENTRAL_DC)
        inbox.wait_for(1)
        assert em.dropped_messages == 3
    finally:
        van.close()
