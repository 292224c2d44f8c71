"""GEOMX_SECRET's default protection, AES-GCM on every message (geomx.transport.sealing), against an attacker who
has what the wire shows: the connection token (PLAIN sends it in clear) and recorded messages, but not the
secret. Every forged, altered, replayed or redirected message is dropped; the node goes on serving."""
import time

import numpy as np
import pytest
import zmq

from geomx.errors import ConfigError, ProtocolError
from geomx.transport.message import Message, encode
from geomx.transport.sealing import MAX_AGE_S, REPLAY_WINDOW, MessageSeal, derive
from geomx.transport.security import Curve, Sealed, link_security
from geomx.transport.van import ZmqVan
from harness import listening_van

SECRET = "correct horse battery staple 42"


@pytest.fixture
def sealed_server():
    with listening_van(Sealed(SECRET)) as served:
        yield served


@pytest.fixture
def wire():
    """A raw DEALER admitted with the deployment's connection token, as an eavesdropper could be."""
    ctx = zmq.Context()
    socks = []

    def connect(address: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        Sealed(SECRET).client(sock)
        sock.connect(address)
        socks.append(sock)
        return sock

    yield connect
    for sock in socks:
        sock.close()
    ctx.term()


def sealed(msg: Message, address: str, *, by: str = "friend", secret: str = SECRET, seal=None) -> list:
    msg.src = msg.src or by
    seal = seal or MessageSeal(derive(secret.encode(), "geomx-aead-master"), by)
    return [bytes(memoryview(f)) for f in seal.seal(encode(msg), address)]


def test_sealed_peers_exchange_small_and_large_tensors_bit_exactly(sealed_server):
    server, inbox = sealed_server
    client = ZmqVan(node_id="client", dc="a", on_message=lambda m: None, security=Sealed(SECRET))
    client.start()
    big = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)     # sealed into an array
    try:
        client.send(server.address, Message("push", fields={"key": 7}, tensors=[np.arange(5.0), big,
                                                                                np.zeros(0, np.int64)]))
        assert inbox.wait_for(1)
        got = inbox.messages[0]
        assert (got.op, got.src, got.fields) == ("push", "client", {"key": 7})
        np.testing.assert_array_equal(got.tensors[0], np.arange(5.0))
        np.testing.assert_array_equal(got.tensors[1], big)
        assert got.tensors[1].flags.writeable and got.tensors[2].shape == (0,)
    finally:
        client.stop()


def test_without_the_secret_a_holder_of_the_connection_token_is_never_heard(sealed_server, wire):
    server, inbox = sealed_server
    sock = wire(server.address)
    abort = Message("abort", src="scheduler-dc:a", fields={"tier": "dc:a", "reason": "forged"})
    sock.send_multipart(encode(abort))                                                  # plaintext
    sock.send_multipart(sealed(abort, server.address, secret="another secret of enough length"))
    sock.send_multipart([b"\x01" + b"\0" * 16 + b"friend"] + encode(abort))            # an envelope, no seal
    time.sleep(0.5)
    assert inbox.messages == [] and server.dropped_messages == 3
    sock.send_multipart(sealed(Message("hello"), server.address))                       # the real secret: heard
    assert inbox.wait_for(1) and [m.op for m in inbox.messages] == ["hello"]


def test_an_altered_replayed_redirected_or_misattributed_message_is_dropped(sealed_server, wire):
    server, inbox = sealed_server
    sock = wire(server.address)
    seal = MessageSeal(derive(SECRET.encode(), "geomx-aead-master"), "friend")
    push = Message("push", fields={"key": 1}, tensors=[np.ones(100_000, np.float32)])
    recorded = sealed(push, server.address, seal=seal)
    sock.send_multipart(recorded)
    assert inbox.wait_for(1)
    tampered = sealed(push, server.address, seal=seal)
    tampered[2] = tampered[2][:-1] + bytes([tampered[2][-1] ^ 1])                       # one bit of the tensor
    swapped = sealed(push, server.address, seal=seal)
    for frames in (recorded,                                                            # replayed as recorded
                   tampered,
                   sealed(push, "tcp://127.0.0.1:1", seal=seal),                        # sealed for another node
                   sealed(Message("shutdown", src="scheduler-dc:a"), server.address, seal=seal),   # src != sealer
                   [swapped[0], swapped[2], swapped[1]]):                               # frames swapped
        sock.send_multipart(frames)
    sock.send_multipart(sealed(Message("hello"), server.address, seal=seal))
    assert inbox.wait_for(2)
    time.sleep(0.3)
    assert [m.op for m in inbox.messages] == ["push", "hello"]
    assert server.dropped_messages == 5


def test_messages_overtaken_within_the_window_are_accepted_once_and_older_ones_refused():
    master = derive(SECRET.encode(), "geomx-aead-master")
    sender, receiver = MessageSeal(master, "friend"), MessageSeal(master, "server")
    frames = [sender.seal(encode(Message("m", src="friend", fields={"i": i})), "tcp://h:9") for i in range(3)]

    def receive(fr):
        letter = receiver.letter(fr[0], 9)
        assert letter.open(0, fr[1])
        letter.accept()

    receive(frames[2])
    receive(frames[0])                       # overtaken by a higher priority (the emulator may reorder)
    with pytest.raises(ProtocolError, match="replayed"):
        receive(frames[0])
    for _ in range(REPLAY_WINDOW):
        sender.seal(encode(Message("m", src="friend")), "tcp://h:9")
    receive(sender.seal(encode(Message("m", src="friend")), "tcp://h:9"))
    with pytest.raises(ProtocolError, match="replayed"):
        receive(frames[1])                  # never seen, but older than the window


def test_a_node_started_afresh_refuses_a_recording_sealed_long_before_it_started(sealed_server, wire):
    # the replay window lives in the receiving process: a new one (a later run with the same secret, a restarted
    # role) has seen nothing, so what was recorded earlier than GEOMX_SEAL_MAX_AGE_S before it started is refused
    server, inbox = sealed_server
    sock = wire(server.address)
    master = derive(SECRET.encode(), "geomx-aead-master")
    earlier = MessageSeal(master, "friend", clock=lambda: time.time() - MAX_AGE_S - 60)   # sealed then
    recent = MessageSeal(master, "friend", clock=lambda: time.time() - MAX_AGE_S / 2)
    sock.send_multipart(sealed(Message("push", fields={"key": 1}), server.address, seal=earlier))
    sock.send_multipart(sealed(Message("hello"), server.address, seal=recent))      # clocks apart, within the limit
    assert inbox.wait_for(1)
    time.sleep(0.3)
    assert [m.op for m in inbox.messages] == ["hello"] and server.dropped_messages == 1


def test_the_age_limit_counts_from_the_receivers_start_and_its_refusal_names_the_variable():
    master = derive(SECRET.encode(), "geomx-aead-master")
    now = [1000.0]
    receiver = MessageSeal(master, "server", max_age_s=30, clock=lambda: now[0])
    old = MessageSeal(master, "friend", clock=lambda: 960.0).seal(encode(Message("m", src="friend")), "tcp://h:9")
    fresh = MessageSeal(master, "friend", clock=lambda: 975.0).seal(encode(Message("m", src="friend")), "tcp://h:9")
    now[0] = 5000.0             # hours later: the limit is against the start, not the arrival (queued, held)
    letter = receiver.letter(fresh[0], 9)
    assert letter.open(0, fresh[1])
    with pytest.raises(ProtocolError, match=r"sealed 40 s before this node started.*GEOMX_SEAL_MAX_AGE_S=30"):
        receiver.letter(old[0], 9)
    configured = link_security({"GEOMX_SECRET": SECRET, "GEOMX_SEAL_MAX_AGE_S": "30"}).sealing("server")
    for age, heard in ((20, True), (40, False)):
        frames = MessageSeal(master, "friend", clock=lambda a=age: time.time() - a).seal(
            encode(Message("m", src="friend")), "tcp://h:9")
        if heard:
            assert configured.letter(frames[0], 9).open(0, frames[1])
        else:
            with pytest.raises(ProtocolError, match="GEOMX_SEAL_MAX_AGE_S=30 s"):
                configured.letter(frames[0], 9)
    # a registration may wait GEOMX_CONNECT_TIMEOUT for a scheduler that starts late: it must still open then
    patient = link_security({"GEOMX_SECRET": SECRET, "GEOMX_CONNECT_TIMEOUT": "600"}).sealing("scheduler")
    queued = MessageSeal(master, "friend", clock=lambda: time.time() - 500).seal(
        encode(Message("register", src="friend")), "tcp://h:9")
    assert patient.letter(queued[0], 9).open(0, queued[1])
    for bad in ("soon", "0", "-5", "nan"):
        with pytest.raises(ConfigError, match=f"GEOMX_SEAL_MAX_AGE_S={bad!r}"):
            link_security({"GEOMX_SECRET": SECRET, "GEOMX_SEAL_MAX_AGE_S": bad})


def test_the_encryption_is_chosen_by_geomx_encryption_and_a_bad_choice_names_the_variable():
    assert isinstance(link_security({"GEOMX_SECRET": SECRET}), Sealed)
    assert isinstance(link_security({"GEOMX_SECRET": SECRET, "GEOMX_ENCRYPTION": "curve"}), Curve)
    with pytest.raises(ConfigError, match="GEOMX_ENCRYPTION='rot13' is not one of"):
        link_security({"GEOMX_SECRET": SECRET, "GEOMX_ENCRYPTION": "rot13"})
    with pytest.raises(ConfigError, match="GEOMX_SECRET must have at least 16 characters"):
        Sealed("short")
