"""The van on its own, in-process: receiving straight into caller arrays, and message order with direct sends."""
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from geomx.transport.message import Message, encode
from geomx.transport.van import ZmqVan
from harness import Inbox, wait_until


@pytest.fixture
def pair():
    inbox = Inbox()
    receiver = ZmqVan(node_id="receiver", dc="a", on_message=inbox)
    sender = ZmqVan(node_id="sender", dc="a", on_message=lambda m: None)
    receiver.start()
    sender.start()
    yield sender, receiver, inbox
    sender.stop()
    receiver.stop()


def test_tensor_is_received_straight_into_the_array_receive_into_names(pair):
    sender, receiver, inbox = pair
    out = np.zeros((3, 4), np.float32)
    seen_headers = []

    def into(header):
        seen_headers.append(header)
        return [out]

    receiver.receive_into = into
    sender.send(receiver.address, Message("reply", fields={"req": 7}, tensors=[np.arange(12.0, dtype=np.float32)
                                                                              .reshape(3, 4)]))
    assert inbox.wait_for(1)
    assert inbox.messages[0].tensors[0] is out
    np.testing.assert_array_equal(out, np.arange(12.0).reshape(3, 4))
    assert seen_headers[0]["f"]["req"] == 7 and seen_headers[0]["op"] == "reply"


def test_a_received_tensor_is_sent_on_as_its_own_frame_and_a_slice_of_it_as_a_view(pair):
    """A server replying with a push it kept as received hands ZeroMQ the received frame (shared by reference
    count); any other array goes as a view of its memory."""
    sender, receiver, inbox = pair
    value = np.arange(40_000, dtype=np.float32).reshape(200, 200)
    sender.send(receiver.address, Message("push", tensors=[value]))
    assert inbox.wait_for(1)
    kept = inbox.messages[0].tensors[0]
    frames = encode(Message("reply", tensors=[kept, kept[:10]]))
    assert isinstance(frames[1], zmq.Frame) and not isinstance(frames[2], zmq.Frame)
    receiver.send(receiver.address, Message("reply", tensors=[kept, kept[:10]]))
    assert inbox.wait_for(2)
    whole, part = inbox.messages[1].tensors
    np.testing.assert_array_equal(whole, value)
    np.testing.assert_array_equal(part, value[:10])


@pytest.mark.parametrize("offered", [np.zeros(12, np.float32),            # another shape
                                     np.zeros((3, 4), np.float64),        # another dtype
                                     np.zeros((4, 3), np.float32).T,      # not C-contiguous
                                     None])
def test_an_array_that_does_not_match_the_header_is_left_alone_and_a_fresh_buffer_used(pair, offered):
    sender, receiver, inbox = pair
    before = None if offered is None else offered.copy()
    receiver.receive_into = lambda header: [offered]
    value = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    sender.send(receiver.address, Message("reply", tensors=[value]))
    assert inbox.wait_for(1)
    got = inbox.messages[0].tensors[0]
    assert got is not offered
    np.testing.assert_array_equal(got, value)
    if offered is not None:
        np.testing.assert_array_equal(offered, before)


def test_a_frame_longer_than_its_header_announces_is_dropped_and_the_van_keeps_receiving(pair):
    sender, receiver, inbox = pair
    target = np.zeros(4, np.float32)
    receiver.receive_into = lambda header: [target] if header["src"] == "rogue" else []
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.linger = 0
    rogue.connect(receiver.address)
    try:
        header = msgpack.packb({"op": "reply", "src": "rogue", "p": 0, "f": {}, "t": [["float32", [4]]]})
        rogue.send_multipart([header, b"\x01" * 64])          # 64 bytes where 16 were announced
        deadline = time.monotonic() + 5
        while receiver.dropped_messages == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.dropped_messages == 1
        good = np.arange(4.0, dtype=np.float32)
        sender.send(receiver.address, Message("reply", tensors=[good]))
        assert inbox.wait_for(1)
        assert len(inbox.messages) == 1 and inbox.messages[0].src == "sender"
        np.testing.assert_array_equal(inbox.messages[0].tensors[0], good)
    finally:
        rogue.close()
        ctx.term()


def test_messages_from_several_threads_arrive_in_each_threads_sending_order(pair):
    """Direct sends (empty queue) and queued sends (contended) mix; per sender thread the order holds."""
    sender, receiver, inbox = pair
    per_thread, threads = 300, 3

    def blast(t):
        for i in range(per_thread):
            sender.send(receiver.address, Message("seq", fields={"t": t, "i": i},
                                                  tensors=[np.full(256 if i % 7 else 65536, i, np.float32)]))

    workers = [threading.Thread(target=blast, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert inbox.wait_for(per_thread * threads, timeout=30)
    for t in range(threads):
        order = [m.fields["i"] for m in inbox.messages if m.fields["t"] == t]
        assert order == list(range(per_thread)), f"thread {t} out of order"


def test_a_handler_that_holds_the_receive_thread_is_recorded_as_a_stall_and_quick_ones_are_not():
    """Heartbeat acks wait unread while a handler runs; the postoffice forgives silence up to a stall's end."""
    from geomx.transport.van import STALL_S

    seen = threading.Event()

    def slow(msg):
        if msg.op == "slow":
            time.sleep(STALL_S + 0.3)
        seen.set()

    receiver = ZmqVan(node_id="receiver", dc="a", on_message=slow)
    sender = ZmqVan(node_id="sender", dc="a", on_message=lambda m: None)
    receiver.start()
    sender.start()
    try:
        sender.send(receiver.address, Message("quick"))
        assert seen.wait(10)
        wait_until(lambda: receiver.handling_since is None, 5, "the quick handler's end")     # not a sleep
        assert receiver.last_stall_end == 0.0
        seen.clear()
        before = time.monotonic()
        sender.send(receiver.address, Message("slow"))
        deadline = time.monotonic() + 10
        while receiver.handling_since is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.handling_since is not None and receiver.handling_since >= before
        assert seen.wait(10)
        wait_until(lambda: receiver.handling_since is None, 5, "the slow handler's end")
        assert receiver.last_stall_end > before + STALL_S
    finally:
        sender.stop()
        receiver.stop()


def test_a_big_endian_array_arrives_with_its_values():
    from geomx.transport.message import decode, encode

    x = np.arange(6, dtype=">f4").reshape(2, 3)
    got = decode(encode(Message("push", tensors=[x]))).tensors[0]
    assert got.dtype == np.float32 and got.dtype.isnative
    np.testing.assert_array_equal(got, np.arange(6, dtype=np.float32).reshape(2, 3))
