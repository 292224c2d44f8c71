"""Bounded send queues (issue 18): a peer that stops reading costs its sender at most the outbox cap, slows only
the traffic to itself, gets everything in order once it reads again, and a peer that never reads again is named
instead of waited for forever."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from geomx.errors import ConfigError, PeerLostError
from geomx.transport.message import Message
from geomx.transport.outbox import send_queue_bytes
from geomx.transport.van import ZmqVan
from harness import SCRIPTS, Inbox

MIB = 1 << 20
CAP_MB = 8


@pytest.fixture
def frozen_reader():
    """A reader in another process, stopped with SIGSTOP once it listens (the kernel's socket buffers and the
    sender's outbox are all that can fill); continued and reaped at the end."""
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "reader.py")], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        os.kill(proc.pid, signal.SIGSTOP)
        yield proc, address
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=10)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def test_a_frozen_peer_holds_the_sender_to_the_cap_without_delaying_other_peers_and_then_gets_everything_in_order(
        frozen_reader):
    proc, address = frozen_reader
    inbox = Inbox()
    other = ZmqVan(node_id="other", dc="a", on_message=inbox)
    sender = ZmqVan(node_id="sender", dc="a", on_message=lambda m: None, send_queue_mb=CAP_MB)
    other.start()
    sender.start()
    try:
        total = 160      # 160 fresh 1 MiB messages: without a bound they would all wait in the sender's memory
        rss_before = _rss_mib()
        finished = threading.Event()

        def produce():
            for i in range(total):
                sender.send(address, Message("data", fields={"i": i}, tensors=[np.full(MIB // 4, i, np.float32)]))
            sender.send(address, Message("end"))
            finished.set()

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        time.sleep(2.0)
        assert not finished.is_set(), "every message was taken while the reader was frozen: nothing pushed back"
        queued = sender._outboxes[address].nbytes
        assert 0 < queued <= CAP_MB * MIB + MIB + 4096, queued
        # the sender's memory: the outbox, ZeroMQ's pipe (16 messages) and the kernel's buffers, not 160 MiB
        assert _rss_mib() - rss_before < CAP_MB + 16 + 48, (rss_before, _rss_mib())
        # another peer is served at once while the frozen one's outbox is full
        started = time.monotonic()
        sender.send(other.address, Message("ping", fields={"i": -1}))
        assert inbox.wait_for(1, timeout=5)
        assert time.monotonic() - started < 1.0
        os.kill(proc.pid, signal.SIGCONT)
        assert finished.wait(timeout=30)
        out, _ = proc.communicate(timeout=30)
        report = json.loads(out.strip().splitlines()[-1])
        assert report == {"count": total, "in_order": True, "first": [0]}
        assert sender.dropped_messages == 0
    finally:
        sender.stop()
        other.stop()


def test_a_peer_that_never_reads_again_is_named_once_its_outbox_has_been_full_for_the_stuck_deadline(frozen_reader):
    _, address = frozen_reader
    sender = ZmqVan(node_id="sender", dc="a", on_message=lambda m: None, send_queue_mb=CAP_MB, stuck_s=1.0)
    sender.start()
    try:
        started = time.monotonic()
        with pytest.raises(PeerLostError) as caught:
            for i in range(1000):
                sender.send(address, Message("data", fields={"i": i}, tensors=[np.full(MIB // 4, i, np.float32)]))
        waited = time.monotonic() - started
        assert 1.0 <= waited < 10, waited
        text = str(caught.value)
        assert address in text and "GEOMX_SEND_QUEUE_MB" in text and "has read nothing for 1 s" in text
        assert sender.dropped_messages == 1
    finally:
        sender.stop(flush_timeout=0.2)


def test_a_message_larger_than_the_cap_is_sent_whole_when_the_outbox_is_empty():
    inbox = Inbox()
    receiver = ZmqVan(node_id="receiver", dc="a", on_message=inbox)
    sender = ZmqVan(node_id="sender", dc="a", on_message=lambda m: None, send_queue_mb=1)
    receiver.start()
    sender.start()
    try:
        big = np.arange(4 * MIB // 4, dtype=np.float32)       # 4 MiB, four times the cap
        for _ in range(3):
            sender.send(receiver.address, Message("big", tensors=[big]))
        assert inbox.wait_for(3, timeout=10)
        for msg in inbox.messages:
            np.testing.assert_array_equal(msg.tensors[0], big)
    finally:
        sender.stop()
        receiver.stop()


@pytest.mark.parametrize("text", ["0", "-5", "many", "nan", "inf"])
def test_a_bad_send_queue_cap_is_refused_naming_the_variable(text):
    with pytest.raises(ConfigError, match="GEOMX_SEND_QUEUE_MB"):
        send_queue_bytes({"GEOMX_SEND_QUEUE_MB": text})


def test_the_send_queue_cap_is_read_in_mib():
    assert send_queue_bytes({}) == 256 * MIB
    assert send_queue_bytes({"GEOMX_SEND_QUEUE_MB": "0.5"}) == MIB // 2


def test_a_handler_sending_to_a_frozen_peer_never_stops_its_node_from_reading(frozen_reader):
    """The receive thread never waits for the cap (two servers replying to each other would deadlock): a node
    whose handler forwards every message to a frozen peer keeps handling messages past the cap, and the frozen
    peer gets every one of them in order once it reads again."""
    proc, address = frozen_reader
    forwarder = None

    def forward(msg):
        forwarder.send(address, Message("data", fields={"i": msg["i"]}, tensors=msg.tensors))

    forwarder = ZmqVan(node_id="forwarder", dc="a", on_message=forward, send_queue_mb=CAP_MB)
    client = ZmqVan(node_id="client", dc="a", on_message=lambda m: None)
    forwarder.start()
    client.start()
    try:
        total = 40
        for i in range(total):
            client.send(forwarder.address, Message("data", fields={"i": i}, tensors=[np.full(MIB // 4, i, np.float32)]))
        deadline = time.monotonic() + 10
        while forwarder._outboxes.get(address) is None or len(forwarder._outboxes[address]) + 16 < total:
            assert time.monotonic() < deadline, "the forwarder stopped handling messages at its cap"
            time.sleep(0.05)
        assert forwarder._outboxes[address].nbytes > CAP_MB * MIB
        os.kill(proc.pid, signal.SIGCONT)
        forwarder.send(address, Message("end"))     # from this thread: it waits for the reader to catch up
        out, _ = proc.communicate(timeout=30)
        assert json.loads(out.strip().splitlines()[-1]) == {"count": total, "in_order": True, "first": [0]}
        assert forwarder.dropped_messages == 0
    finally:
        client.stop()
        forwarder.stop()
