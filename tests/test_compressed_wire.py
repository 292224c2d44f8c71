"""The wire half of compression (geomx/cluster/compressed.py) without processes: payloads that come off the
network are checked before they touch a server's state, and streams keep what they have not sent yet."""
from __future__ import annotations

import numpy as np
import pytest

from geomx.cluster.compressed import ClientWire, ServerWire, WireError, decode
from geomx.cluster.kvserver import KeyState
from geomx.compression import make_codec, parse_policy


def _payload(codec_spec, x, count=1):
    policy = parse_policy({"wan": codec_spec, "size_lower_bound": 0})
    return ClientWire(policy, "wan", weights=False, salt="t").encode_push("k", x, x.dtype, count)


def test_a_push_decodes_to_what_was_sent_and_a_summed_push_is_scaled_back():
    x = np.arange(12, dtype=np.float32).reshape(3, 4) * 1000     # a sum of 4 workers: sent as their mean
    tensors, fields = _payload("fp16", x, count=4)
    assert tensors[0].dtype == np.float16 and tensors[0].nbytes == x.size * 2
    np.testing.assert_array_equal(decode(make_codec("fp16"), fields["cm"], tensors, (3, 4)), x)


@pytest.mark.parametrize("bad_index", [-1, 100])
def test_a_sparse_payload_with_an_index_outside_the_tensor_is_refused(bad_index):
    tensors, fields = _payload({"type": "topk", "ratio": 0.1}, np.ones(100, np.float32))
    idx = tensors[0].copy()
    idx[0] = bad_index
    with pytest.raises(WireError, match=r"not all in \[0, 100\)"):
        decode(make_codec({"type": "topk", "ratio": 0.1}), fields["cm"], [idx, tensors[1]], (100,))


def test_a_payload_of_another_codec_or_shape_is_refused_naming_both():
    tensors, fields = _payload({"type": "topk", "ratio": 0.1}, np.ones(100, np.float32))
    with pytest.raises(WireError, match="compressed with 'topk', but the compression policy gives 'fp16'"):
        decode(make_codec("fp16"), fields["cm"], tensors, (100,))
    with pytest.raises(WireError, match=r"shape \[100\], the key \(10, 10\)"):
        decode(make_codec({"type": "topk", "ratio": 0.1}), fields["cm"], tensors, (10, 10))
    with pytest.raises(WireError, match="malformed"):
        decode(make_codec("fp16"), "junk", tensors, (100,))


def test_a_server_refuses_a_compressed_push_for_a_key_that_travels_dense():
    policy = parse_policy({"type": "bsc", "threshold": 0.01})     # default bound: 200,000 elements
    server = ServerWire(policy, "wan", weights=False, per_client=False, salt="s", place_of=str)
    st = KeyState("bias", (10,), np.dtype(np.float32), value=np.zeros(10, np.float32))
    tensors, fields = _payload({"type": "bsc", "threshold": 0.5}, np.ones(10, np.float32))
    with pytest.raises(WireError, match="key 'bias' travels uncompressed"):
        server.decode_push(st, fields, tensors)
    assert server.decode_push(st, {}, [np.ones(10, np.float32)]) is None      # dense pushes pass as they are


def test_weight_changes_sent_to_a_client_add_up_to_the_servers_weights():
    """Weights mode in one process: the server sends top-k of each change with a residual; the client's
    replica reaches the server's weights once the changes stop and the residual drains."""
    policy = parse_policy({"wan": {"type": "topk", "ratio": 0.25}, "size_lower_bound": 0})
    server = ServerWire(policy, "wan", weights=True, per_client=False, salt="s", place_of=str)
    client = ClientWire(policy, "wan", weights=True, salt="c")
    rng = np.random.default_rng(0)
    w = rng.standard_normal(40).astype(np.float32)
    st = KeyState("w", (40,), np.dtype(np.float32), value=w)
    server.note_dense(st, "c1", w)
    client.note_dense("w", w)
    for step in range(20):
        if step < 5:
            w = w - rng.standard_normal(40).astype(np.float32)
        st.value = w
        tensors, fields = server.encode_reply(st, "c1", w)
        assert "cm" in fields and np.count_nonzero(tensors[1]) <= 10
        replica = client.decode_reply("w", fields, tensors, (40,), np.float32)
    np.testing.assert_allclose(replica, w, rtol=0, atol=1e-5)


def test_the_master_worker_reads_whole_values_while_workers_get_the_rounds_compressed_reply():
    """The master worker keeps no codec streams: its pull, answered after a round, must not get the round's
    compressed reply (an mpq run's master once crashed on 'a compressed reply ... which travels uncompressed')."""
    from geomx.cluster.kvserver import KVServer
    from geomx.cluster.postoffice import NodeInfo
    from geomx.transport.message import Message

    class Van:
        def __init__(self):
            self.sent = []

        def send(self, addr, msg, dst_dc=None):
            self.sent.append((addr, msg))

    class Po:
        metrics_fields: list = []
        node_id = "server"
        van = Van()

        def add_periodic_check(self, check):
            pass

    server = KVServer(Po())
    server.clients = {"w": NodeInfo("w", "local_server", "worker", "a", 0, "tcp://w"),
                      "m": NodeInfo("m", "master", "worker", "central", 0, "tcp://m")}
    server.wire = ServerWire(parse_policy({"wan": {"type": "topk", "ratio": 0.25}, "size_lower_bound": 0}), "wan",
                             weights=False, per_client=False, salt="s", place_of=server.client_place)
    st = server.keys["k"] = KeyState("k", (100,), np.dtype(np.float32), value=np.zeros(100, np.float32))
    mean = np.arange(100, dtype=np.float32)
    server.set_value(st, mean, ["w"])                 # a round: its mean gradient is encoded once
    for src in ("w", "m"):
        server.reply_value(Message("pull", src=src, fields={"key": "k", "req": 1}), st)
    (_, to_worker), (_, to_master) = Po.van.sent
    assert "cm" in to_worker.fields and len(to_worker.tensors) == 2          # top-k: indices and values
    assert "cm" not in to_master.fields
    np.testing.assert_array_equal(to_master.tensors[0], mean)
