"""The in-memory van, and whole deployments inside one pytest process over it: the real schedulers, global
server, local servers and KVStores as threads. Each test takes about a second."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from harness import Inbox
from inproc import DEADLINE_S, HipsCluster

from geomx.errors import ConfigError
from geomx.netem.link import EmulatedLink
from geomx.transport.base import Van, van_kinds
from geomx.transport.inproc import Hub, InProcVan
from geomx.transport.message import Message

KEYS = {"w": (6, 5), 3: (17,)}


@pytest.fixture
def pair():
    hub, inbox = Hub(), Inbox()
    receiver = Van.create("inproc", node_id="receiver", dc="a", on_message=inbox, hub=hub)
    sender = Van.create("inproc", node_id="sender", dc="a", on_message=lambda m: None, hub=hub)
    receiver.start()
    sender.start()
    yield sender, receiver, inbox
    sender.stop()
    receiver.stop()


def test_the_factory_makes_vans_by_kind_and_names_the_kinds_for_an_unknown_one():
    assert {"inproc", "zmq"} <= set(van_kinds())
    van = Van.create("inproc", node_id="n", dc="a", on_message=lambda m: None, hub=Hub())
    assert isinstance(van, InProcVan)
    with pytest.raises(ConfigError, match="unknown van kind 'rdma'; kinds are inproc, zmq"):
        Van.create("rdma", node_id="n", dc="a", on_message=lambda m: None)
    with pytest.raises(ConfigError, match="cannot use the WAN emulator"):
        Van.create("inproc", node_id="n", dc="a", on_message=lambda m: None, emulator="tcp://127.0.0.1:9")


def test_a_message_arrives_as_a_copy_in_the_arrays_receive_into_names(pair):
    sender, receiver, inbox = pair
    out = np.zeros((3, 4), np.float32)
    receiver.receive_into = lambda header: [out]
    sent = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    sender.send(receiver.address, Message("reply", fields={"req": 7}, tensors=[sent, np.ones(2, np.int64)]))
    sent += 100                    # the sender's array changes after the send: the receiver must not see it
    assert inbox.wait_for(1)
    msg = inbox.messages[0]
    assert msg.tensors[0] is out and msg.src == "sender" and msg.get("req") == 7
    np.testing.assert_array_equal(out, np.arange(12.0, dtype=np.float32).reshape(3, 4))
    np.testing.assert_array_equal(msg.tensors[1], [1, 1])
    assert sender.counters()["sent_messages"] == {"a": 1} and receiver.counters()["received"] > 48


def test_queued_messages_are_handled_by_priority_then_in_order():
    hub, order, busy, gate = Hub(), [], threading.Event(), threading.Event()

    def handle(msg):
        busy.set()
        gate.wait(DEADLINE_S)          # the first message holds the receive thread while the others queue up
        order.append(msg.get("i"))

    receiver = InProcVan(node_id="r", dc="a", on_message=handle, hub=hub)
    sender = InProcVan(node_id="s", dc="a", on_message=lambda m: None, hub=hub)
    receiver.start()
    sender.start()
    try:
        for i, prio in enumerate([0, 0, 5, 0, 5]):
            sender.send(receiver.address, Message("m", fields={"i": i}, priority=prio))
            if i == 0:
                assert busy.wait(DEADLINE_S)
        gate.set()
        end = time.monotonic() + DEADLINE_S
        while len(order) < 5 and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        sender.stop()
        receiver.stop()
    # message 0 was taken before the others arrived; then priority 5 (2, 4), then 0 in order (1, 3)
    assert order == [0, 2, 4, 1, 3]


def _grad(step: int, dc: str, rank: int, shape) -> np.ndarray:
    # small integers: every sum and the division by 4 are exact in float32, whatever the order of arrival
    return np.random.default_rng([step, ord(dc), rank]).integers(-8, 9, size=shape).astype(np.float32)


def _train(cluster: HipsCluster, steps: int) -> None:
    """Every worker pushes and pulls each key; each reads the mean over all 4 workers, exactly."""
    for key, shape in KEYS.items():
        cluster.master.init(key, np.zeros(shape, np.float32))
    for kvs in cluster.workers.values():
        for kv in kvs:
            for key, shape in KEYS.items():
                kv.init(key, np.zeros(shape, np.float32))
    for step in range(steps):
        outs, handles = {}, []
        for dc, kvs in cluster.workers.items():
            for rank, kv in enumerate(kvs):
                for key, shape in KEYS.items():
                    out = outs[(dc, rank, key)] = np.empty(shape, np.float32)
                    handles.append(kv.pushpull(key, _grad(step, dc, rank, shape), out=out))
        for h in handles:
            h.wait(DEADLINE_S)
        for key, shape in KEYS.items():
            mean = sum(_grad(step, dc, r, shape) for dc, kvs in cluster.workers.items()
                       for r in range(len(kvs))) / np.float32(4)
            for dc, kvs in cluster.workers.items():
                for rank in range(len(kvs)):
                    np.testing.assert_array_equal(outs[(dc, rank, key)], mean, err_msg=f"step {step} {dc}{rank}")


def test_a_whole_2dc_deployment_runs_in_one_process_over_the_in_memory_van():
    cluster = HipsCluster(dcs=("a", "b"), per_dc=2)
    try:
        _train(cluster, steps=3)
        # the DC sums crossed to the global server once per key and round: 2 DCs x 2 keys x 3 rounds
        wan = sum(cluster.local[dc].po.van.counters()["sent_messages"].get("central", 0) for dc in ("a", "b"))
        assert wan >= 12
    finally:
        cluster.close()


@pytest.mark.parametrize("tier, expected, member, named", [
    ("global", {"server": 1, "worker": 2}, ("server", "a", "worker"),
     ["1 of 1 global server(s) (registered: none)", "1 of 2 DCs' local servers (registered: DC a)"]),
    ("dc:a", {"server": 1, "worker": 1}, ("worker", "a", "worker"),
     ["1 of 1 server(s) (registered: none)", "if it runs, it is waiting for the global tier"]),
], ids=["global tier names the DCs", "a DC's tier says where its server may wait"])
def test_an_incomplete_tier_names_what_is_missing_in_the_users_words_and_who_registered(tier, expected, member, named):
    """The global scheduler had said 'still waiting for 1 worker(s)' (a DC's local server, no DC named), and a DC's
    scheduler 'still waiting for 1 server(s)' while that server ran, waiting for the global tier."""
    from geomx.cluster.postoffice import Postoffice
    from geomx.cluster.scheduler import Scheduler
    from geomx.config import NodeConfig
    from geomx.errors import PeerLostError
    from geomx.profiles import CENTRAL_DC

    hub = Hub()
    sched = Scheduler(tier=tier, dc=CENTRAL_DC if tier == "global" else "a", expected=expected, port=0,
                      connect_timeout=0.3, van="inproc", van_options={"hub": hub})
    serving = threading.Thread(target=sched.serve, daemon=True)
    serving.start()
    while not sched.van.port:
        time.sleep(0.005)
    role, dc, tier_role = member
    po = Postoffice(NodeConfig(role=role, dc=dc, van="inproc", van_options={"hub": hub}, connect_timeout=DEADLINE_S))
    po.start()
    try:
        with pytest.raises(PeerLostError) as aborted:
            po.join(tier, (hub.name, sched.van.port), sched.dc, tier_role, {"dc_workers": 1})
    finally:
        po.close()
        serving.join(DEADLINE_S)
        hub.close()
    said = str(aborted.value)
    assert f"the {tier} tier is incomplete after 0.3 s" in said and all(n in said for n in named), said


def test_cross_dc_messages_take_the_emulated_link_and_intra_dc_ones_do_not():
    delay = 0.05
    cluster = HipsCluster(dcs=("a", "b"), per_dc=2, link=lambda src, dst: EmulatedLink(
        name=f"{src}->{dst}", rate_bps=1e9, one_way_delay_s=delay))
    try:
        start = time.monotonic()
        _train(cluster, steps=2)
        took = time.monotonic() - start
        links = {pair: link.snapshot() for pair, link in cluster.hub.links().items()}
    finally:
        cluster.close()
    assert {("a", "central"), ("central", "a"), ("b", "central"), ("central", "b")} <= set(links)
    assert all(src != dst for src, dst in links)          # a DC's own traffic never takes a link
    assert all(s["messages"] > 0 and s["bytes"] > 0 for s in links.values())
    # the master's init, each DC's init fetch and 2 rounds: at least 4 WAN round trips one after another
    assert took >= 4 * 2 * delay


def test_message_ops_and_commands_are_spelled_only_in_the_protocol_module():
    """Every op of the cluster's protocol is built and compared through geomx.cluster.protocol's names, never as
    a string literal (geomx/bench's raw van benchmarks send messages of their own)."""
    import re
    from pathlib import Path

    from geomx.cluster.protocol import Command, Op

    root = Path(__file__).resolve().parent.parent / "geomx"
    literal = re.compile(r'(Message\(|\.op\s*[!=]=\s*|send_to_scheduler\(|_request\(|command\(|_send\(\w+, )"')
    offenders = [f"{path.relative_to(root)}:{n}: {line.strip()}"
                 for layer in ("cluster", "kvstore", "torch", "sync") for path in (root / layer).rglob("*.py")
                 if path.name != "protocol.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert offenders == []
    values = [v for cls in (Op, Command) for k, v in vars(cls).items() if k.isupper()]
    assert len(values) == len(set(values))


def test_mxnet_device_lists_push_their_sum_and_pull_into_every_output():
    """MXNet's forms for a worker with several devices: ``push(key, [v1, v2])`` sends the devices' sum,
    ``pull(key, out=[o1, o2])`` fills every output, ``init(key, [v, v])`` starts from the (equal) value;
    devices whose values differ in shape are named."""
    from geomx.errors import KVError

    cluster = HipsCluster(dcs=("a", "b"), per_dc=1)
    try:
        shape = (3, 4)
        cluster.master.init("w", np.zeros(shape, np.float32))
        kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
        for kv in kvs:
            kv.init("w", [np.zeros(shape, np.float32)] * 2)
        handles = [kv.push("w", [np.full(shape, 1.0 + i, np.float32), np.full(shape, 10.0, np.float32)])
                   for i, kv in enumerate(kvs)]       # device sums 11 and 12
        for h in handles:
            h.wait(DEADLINE_S)
        outs = [np.zeros(shape, np.float32) for _ in range(2)]
        kvs[0].pull("w", out=outs).wait(DEADLINE_S)
        for out in outs:
            np.testing.assert_array_equal(out, np.full(shape, 11.5, np.float32))   # the mean of 11 and 12
        with pytest.raises(KVError, match=r"key 'w' from several devices have different shapes"):
            kvs[0].push("w", [np.zeros(shape, np.float32), np.zeros(4, np.float32)])
    finally:
        cluster.close()


def test_set_optimizer_after_init_as_mxnet_orders_it_runs_the_optimizer_from_the_initial_weights():
    """MXNet's own test order: init, then set_optimizer, then pushes. Allowed while no key has been pushed; the
    optimizer starts from the keys' initial values. Once a key has been pushed, a later call is refused."""
    from geomx.errors import KVError

    cluster = HipsCluster(dcs=("a", "b"), per_dc=1)
    try:
        w0 = np.arange(6, dtype=np.float32).reshape(2, 3)
        cluster.master.init("w", w0)
        kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
        for kv in kvs:
            kv.init("w", np.zeros_like(w0))
        cluster.master.set_optimizer("SGD", lr=0.5)
        grads = [np.full_like(w0, 2.0), np.full_like(w0, 4.0)]
        for h in [kv.push("w", g) for kv, g in zip(kvs, grads, strict=True)]:
            h.wait(DEADLINE_S)
        np.testing.assert_array_equal(kvs[0].pull("w").wait(DEADLINE_S), w0 - 0.5 * 3.0)   # the mean gradient 3
        with pytest.raises(KVError, match="key 'w' has been pushed"):
            cluster.master.set_optimizer("Adam", lr=0.1)
    finally:
        cluster.close()


def _weights_after_sampled_compression(codec: str | None, *,
                                       server_optimizer: bool = True) -> dict[tuple[str, int], np.ndarray]:
    """2 DCs x 2 workers, the servers' SGD with momentum, ``codec`` (None: dense) on both tiers: each worker's
    weights after 4 rounds, by (DC, rank). A worker's gradients follow its DC and rank, as a real job's data
    shard does, not the order in which the workers joined. Without ``server_optimizer``: the round's mean
    gradient each worker reads."""
    cluster = HipsCluster(dcs=("a", "b"), per_dc=2)
    try:
        kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
        if codec is not None:
            for kv in [cluster.master, *kvs]:
                kv.set_gradient_compression({"lan": codec, "wan": codec, "size_lower_bound": 1})
        if server_optimizer:
            cluster.master.set_optimizer("SGD", lr=0.1, momentum=0.9)
        w0 = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
        cluster.master.init("w", w0)
        for kv in kvs:
            kv.init("w", np.zeros_like(w0))
        final = {}
        for step in range(4):
            grads = {kv: np.random.default_rng([ord(kv.dc), kv.rank, step]).standard_normal(w0.shape)
                     .astype(np.float32) for kv in kvs}
            handles = {kv: kv.pushpull("w", g) for kv, g in grads.items()}
            final = {(kv.dc, kv.rank): h.wait(DEADLINE_S).copy() for kv, h in handles.items()}
        return final
    finally:
        cluster.close()


@pytest.mark.parametrize("codec", ["qsgd", "randomk", "powersgd", "terngrad"])
def test_a_synchronous_run_with_a_sampled_codec_and_the_servers_optimizer_repeats_and_keeps_one_model(codec):
    """With a server optimizer each client's weight changes come down on a stream of its own, whose random
    draws (stochastic rounding, sampled coordinates, PowerSGD's start) are seeded from names, not from a
    process's random id: two runs give the same weights bit for bit (before, every run drew otherwise), and in
    synchronous rounds every worker holds the same weights (before, they drifted apart: terngrad by 1.4). The
    dense run is the control that the codec changed what arrived."""
    first, again = _weights_after_sampled_compression(codec), _weights_after_sampled_compression(codec)
    dense = _weights_after_sampled_compression(None)
    assert sorted(first) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    for worker, weights in first.items():
        np.testing.assert_array_equal(weights, again[worker], err_msg=f"{codec}: worker {worker}")
        np.testing.assert_array_equal(weights, first[("a", 0)], err_msg=f"{codec}: worker {worker} vs a/0")
        assert not np.array_equal(weights, dense[worker]), f"{codec} changed nothing"


@pytest.mark.parametrize("codec", ["qsgd", "randomk", "powersgd", "terngrad"])
def test_with_a_sampled_codec_every_dcs_workers_read_the_same_mean_gradient(codec):
    """Without a server optimizer the round's mean comes down compressed once per server: each DC's local
    server drew its own random numbers (a seed of its own name), so the DCs' workers applied different
    gradients and their models drifted apart (found by a review: terngrad by 0.24 in 5 steps). Every server
    of a tier now draws alike for the mean, and every worker reads the same gradient."""
    means = _weights_after_sampled_compression(codec, server_optimizer=False)
    dense = _weights_after_sampled_compression(None, server_optimizer=False)
    for worker, mean in means.items():
        np.testing.assert_array_equal(mean, means[("a", 0)], err_msg=f"{codec}: worker {worker} vs a/0")
    assert not np.array_equal(means[("a", 0)], dense[("a", 0)]), f"{codec} changed nothing"


def test_workers_started_without_a_rank_seed_their_codec_streams_apart_by_the_rank_their_scheduler_gave():
    """Hand-started GeoMX workers name no rank (no GEOMX_RANK / DMLC_WORKER_ID); their scheduler ranks them.
    Each worker's push streams are seeded from its place in its tier, rank included, so two workers of a DC
    do not draw the same random numbers (before, both were 'worker of DC a' and drew alike)."""
    cluster = HipsCluster(dcs=("a",), per_dc=2, workers_ask_ranks=False)
    try:
        kvs = cluster.workers["a"]
        assert all(kv.po.cfg.rank is None for kv in kvs)
        for kv in [cluster.master, *kvs]:
            kv.set_gradient_compression({"lan": "qsgd", "size_lower_bound": 1})
        cluster.master.init("w", np.zeros(8, np.float32))
        for kv in kvs:
            kv.init("w", np.zeros(8, np.float32))
        salts = {kv.rank: kv._client.wire.salt for kv in kvs}
        assert salts == {0: "worker 0 of DC a", 1: "worker 1 of DC a"}, salts
    finally:
        cluster.close()


@pytest.mark.parametrize("server_bound", [None, 10])
def test_the_size_bound_set_on_the_global_server_decides_what_every_process_compresses(server_bound):
    """GeoMX's Bi-Sparse script sets MXNET_KVSTORE_SIZE_LOWER_BOUND on its servers. A 100-element key under a
    top-k WAN codec (ratio 1/4) crosses the WAN dense with the default bound (200,000 elements: the exact mean
    comes back) and sparsified with the servers' bound of 10 (a quarter of the entries); the workers' own
    set_gradient_compression calls, with the default bound, agree with the servers either way."""
    cluster = HipsCluster(dcs=("a", "b"), per_dc=1,
                          global_server_fields={"size_lower_bound": server_bound} if server_bound else None)
    try:
        kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
        for kv in [cluster.master, *kvs]:
            kv.set_gradient_compression({"wan": {"type": "topk", "ratio": 0.25}})
        cluster.master.init("g", np.zeros(100, np.float32))
        for kv in kvs:
            kv.init("g", np.zeros(100, np.float32))
        grad = np.arange(1, 101, dtype=np.float32)
        results = [h.wait(DEADLINE_S) for h in [kv.pushpull("g", grad) for kv in kvs]]
        for got in results:
            exact = np.count_nonzero(got == grad)           # both workers pushed grad: its mean is grad
            assert exact == (25 if server_bound else 100), got
    finally:
        cluster.close()


def test_the_size_bound_judges_a_tensor_that_travels_in_parts_by_the_whole_tensor_not_by_one_part():
    """Over slow links the launcher cuts tensors into parts of 65,536 elements, below the default bound of
    200,000: judged part by part, a sparsifier sent every large tensor dense. A 400,000-element tensor in 4 parts
    is sparsified in every part (a quarter of the entries under top-k 1/4); a 150,000-element one in 2 parts is
    below the bound as a whole and stays dense (every entry exact)."""
    cluster = HipsCluster(dcs=("a", "b"), per_dc=1)
    try:
        kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
        for kv in [cluster.master, *kvs]:
            kv.set_gradient_compression({"wan": {"type": "topk", "ratio": 0.25}})
        sizes = {"large": 400_000, "under": 150_000}
        for kv in [cluster.master, *kvs]:
            for key, n in sizes.items():
                kv.init(key, np.zeros(n, np.float32), slice_elements=-(-n // (4 if key == "large" else 2)))
        for key, n in sizes.items():
            grad = np.arange(1, n + 1, dtype=np.float32)
            for got in [h.wait(DEADLINE_S) for h in [kv.pushpull(key, grad) for kv in kvs]]:
                exact = np.count_nonzero(got == grad)       # both workers pushed grad: its mean is grad
                assert exact == (n // 4 if key == "large" else n), (key, exact)
    finally:
        cluster.close()


def test_workers_of_a_geomx_mixedsync_script_join_with_dist_sync_while_the_master_asks_for_dist_async():
    """GeoMX's MixedSync scripts give dist_async to the master worker only; their workers create dist_sync
    (synchronous inside the DC). They join, and the servers run asynchronously; the converse is refused."""
    from geomx.errors import ConfigError

    cluster = HipsCluster(dcs=("a", "b"), per_dc=1, mode="dist_sync", master_mode="dist_async")
    try:
        cluster.master.init("w", np.zeros(4, np.float32))
        kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
        for kv in kvs:
            kv.init("w", np.zeros(4, np.float32))
        assert cluster.global_server.mode == "dist_async" and [kv.type for kv in kvs] == ["dist_sync"] * 2
        first = kvs[0].pushpull("w", np.ones(4, np.float32)).wait(DEADLINE_S)   # DC b has not pushed: no wait
        assert first.shape == (4,) and np.isfinite(first).all()
    finally:
        cluster.close()
    cluster = HipsCluster(dcs=("a", "b"), per_dc=1, mode="dist_async", master_mode="dist_sync")
    try:
        cluster.master.init("w", np.zeros(4, np.float32))
        with pytest.raises(ConfigError, match="created a 'dist_async' kvstore but the master worker created "
                                              "'dist_sync'"):
            cluster.workers["a"][0].init("w", np.zeros(4, np.float32))
    finally:
        cluster.close()


@pytest.mark.parametrize("allowed", [True, False])
def test_a_users_own_optimizer_class_runs_on_the_global_server_only_where_its_module_is_allowed(allowed):
    """kv.set_optimizer(MyOptimizer) names the class by its module; the global server imports it only if its
    operator listed the module in GEOMX_OPTIMIZER_MODULES (a configuration message never imports code
    otherwise), and says so when not."""
    from custom_optim import HalfStepSGD

    from geomx.errors import KVError

    cluster = HipsCluster(dcs=("a",), per_dc=1,
                          global_server_fields={"optimizer_modules": ("custom_optim",)} if allowed else None)
    try:
        if not allowed:
            with pytest.raises(KVError, match="'custom_optim.HalfStepSGD' is not from .* GEOMX_OPTIMIZER_MODULES"):
                cluster.master.set_optimizer(HalfStepSGD, lr=1.0)
            return
        cluster.master.set_optimizer(HalfStepSGD, lr=1.0)
        cluster.master.init("w", np.full(3, 10.0, np.float32))
        (kv,) = cluster.workers["a"]
        kv.init("w", np.zeros(3, np.float32))
        got = kv.pushpull("w", np.full(3, 4.0, np.float32)).wait(DEADLINE_S)
        np.testing.assert_array_equal(got, np.full(3, 8.0, np.float32))       # 10 - 1.0 * 4 / 2
    finally:
        cluster.close()


def _kvs(cluster: HipsCluster) -> list:
    return [kv for kvs in cluster.workers.values() for kv in kvs]


def test_a_raw_kvstore_returns_the_sum_of_the_round_as_mxnet_does_and_several_pushes_leave_the_last_round():
    """MXNet's and GeoMX's servers give back the sum of a round's pushes (a ported script divides by it): 2 DCs
    x 2 workers pushing rank + 1 read 1 + 2 + 3 + 4 = 10; three rounds pushed before one pull leave the last
    round's sum, not an accumulation; dist_async without an optimizer relays every DC's sum undivided."""
    cluster = HipsCluster(dcs=("a", "b"), per_dc=2, reduction=None)
    try:
        kvs = cluster.init_everywhere("g", np.zeros((2, 3), np.float32))
        assert [kv.reduction for kv in kvs] == ["sum"] * 4 and cluster.global_server.reduction == "sum"
        results = [h.wait(DEADLINE_S) for h in [kv.pushpull("g", np.full((2, 3), i + 1.0, np.float32))
                                                for i, kv in enumerate(kvs)]]
        for got in results:
            np.testing.assert_array_equal(got, np.full((2, 3), 10.0, np.float32))
        for round_ in range(3):
            for i, kv in enumerate(kvs):
                kv.push("g", np.full((2, 3), (round_ + 1) * (i + 1.0), np.float32))
        for kv in kvs:
            np.testing.assert_array_equal(kv.pull("g").wait(DEADLINE_S), np.full((2, 3), 30.0, np.float32))
    finally:
        cluster.close()


def test_a_server_optimizer_steps_on_the_sum_by_default_and_on_the_mean_when_asked():
    """GeoMX hands its server optimizer the sum of the round (its DCASGD example's learning rate is set for
    it); a kvstore created with reduction='mean' hands it the mean over all training workers."""
    for reduction, gradient in ((None, 6.0), ("mean", 3.0)):
        cluster = HipsCluster(dcs=("a", "b"), per_dc=1, reduction=reduction)
        try:
            cluster.master.set_optimizer("SGD", lr=0.5)
            kvs = cluster.init_everywhere("w", np.full(3, 10.0, np.float32))
            for h in [kv.push("w", np.full(3, g, np.float32)) for kv, g in zip(kvs, (2.0, 4.0), strict=True)]:
                h.wait(DEADLINE_S)
            np.testing.assert_array_equal(kvs[0].pull("w").wait(DEADLINE_S),
                                          np.full(3, 10.0 - 0.5 * gradient, np.float32))
        finally:
            cluster.close()


def test_a_worker_asking_for_the_mean_where_the_master_sums_is_refused_at_init_naming_both():
    """DistributedOptimizer on the workers but a raw KVStore on the master: the workers would read sums as means
    (a learning rate four times too large); the first init names the mismatch and the fix."""
    cluster = HipsCluster(dcs=("a",), per_dc=1, reduction=None)
    try:
        cluster.master.init("w", np.zeros(3, np.float32))
        (kv,) = cluster.workers["a"]
        kv.set_reduction("mean")
        with pytest.raises(ConfigError, match="asks for the mean of each round but the master worker's gives "
                                              "the sum .*DistributedOptimizer"):
            kv.init("w", np.zeros(3, np.float32))
    finally:
        cluster.close()


def test_the_reduction_is_named_before_the_first_init_and_only_sum_or_mean():
    cluster = HipsCluster(dcs=("a",), per_dc=1, reduction=None)
    try:
        with pytest.raises(ConfigError, match="reduction='max' is not one of sum, mean"):
            cluster.master.set_reduction("max")
        cluster.master.set_reduction("mean")
        (kv,) = cluster.init_everywhere("w", np.zeros(3, np.float32))
        assert kv.reduction == "mean" and cluster.global_server.reduction == "mean"
        with pytest.raises(ConfigError, match=r"set_reduction\('sum'\) must come before the first kv.init"):
            cluster.master.set_reduction("sum")
    finally:
        cluster.close()


def test_distributed_optimizer_refuses_a_kvstore_created_to_sum():
    torch = pytest.importorskip("torch")
    from geomx.torch import DistributedOptimizer

    cluster = HipsCluster(dcs=("a",), per_dc=1, reduction="sum")
    try:
        model = torch.nn.Linear(2, 1)
        with pytest.raises(ConfigError, match="averages the workers' gradients, but this kvstore was created with "
                                              "reduction='sum'"):
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, kvstore=cluster.master)
    finally:
        cluster.close()


def test_geomx_hfa_through_the_raw_kvstore_averages_in_the_dc_then_across_dcs_every_k2_rounds(monkeypatch):
    """GeoMX's HFA scripts (MXNET_KVSTORE_USE_HFA=1) push w / n_local and pull: with K2 = 2 the first round
    gives each DC its own average model, the second the average over the DCs (milestone + the mean of the DCs'
    changes), and the third is a DC average again, starting from it."""
    monkeypatch.setenv("MXNET_KVSTORE_USE_HFA", "1")
    monkeypatch.setenv("MXNET_KVSTORE_HFA_K2", "2")
    w0 = np.full(4, 8.0, np.float32)
    cluster = HipsCluster(dcs=("a", "b"), per_dc=2, reduction=None)
    try:
        kvs = cluster.init_everywhere("w", w0)
        assert cluster.global_server.hfa_k2 == 2

        def round_(models):
            handles = [kv.pushpull("w", m / np.float32(2)) for kv, m in zip(kvs, models, strict=True)]
            return [h.wait(DEADLINE_S) for h in handles]

        first = [np.full(4, v, np.float32) for v in (10.0, 12.0, 20.0, 24.0)]     # DC a: 11, DC b: 22
        got = round_(first)
        for value, expected in zip(got, (11.0, 11.0, 22.0, 22.0), strict=True):
            np.testing.assert_array_equal(value, np.full(4, expected, np.float32))
        second = [np.full(4, v, np.float32) for v in (12.0, 14.0, 30.0, 34.0)]    # DC a: 13, DC b: 32
        got = round_(second)
        # milestone 8 + ((13 - 8) + (32 - 8)) / 2 = 22.5, everywhere
        for value in got:
            np.testing.assert_array_equal(value, np.full(4, 22.5, np.float32))
        third = [np.full(4, v, np.float32) for v in (23.0, 25.0, 21.0, 21.0)]
        got = round_(third)
        for value, expected in zip(got, (24.0, 24.0, 21.0, 21.0), strict=True):
            np.testing.assert_array_equal(value, np.full(4, expected, np.float32))
        states = [cluster.local[dc].keys["w"].hfa.state_dict() for dc in ("a", "b")]
        assert [s["rounds"] for s in states] == [3, 3]
        for s in states:
            np.testing.assert_array_equal(s["milestone"], np.full(4, 22.5, np.float32))
    finally:
        cluster.close()


def test_geomx_hfa_server_logic_takes_no_server_optimizer_and_a_kvstore_asking_for_the_mean_is_not_geomx_hfa(
        monkeypatch):
    """GeoMX's HFA sums the DCs' shares of the model change with no optimizer on the global servers: installing
    one is refused by name; a master whose kvstore asks for the mean is not running a GeoMX HFA script, so the
    servers do not run HFA's logic and a raw push is refused rather than silently run as FSA."""
    monkeypatch.setenv("MXNET_KVSTORE_USE_HFA", "1")
    from geomx.errors import KVError

    cluster = HipsCluster(dcs=("a",), per_dc=1, reduction=None)
    try:
        with pytest.raises(KVError, match="sync 'hfa' .* conflicts with a server optimizer"):
            cluster.master.set_optimizer("SGD", lr=0.1)
    finally:
        cluster.close()
    cluster = HipsCluster(dcs=("a",), per_dc=1, reduction="mean")
    try:
        (kv,) = cluster.init_everywhere("w", np.zeros(3, np.float32))
        assert cluster.global_server.hfa_k2 is None
        with pytest.raises(ConfigError, match="MXNET_KVSTORE_USE_HFA='1' asks for hfa.*DistributedOptimizer"):
            kv.push("w", np.ones(3, np.float32))
    finally:
        cluster.close()


@pytest.mark.parametrize("reduction", [None, "mean"])
def test_mixedsync_overlap_answers_a_dc_with_its_own_round_reduced_as_the_deployment_asks(reduction):
    """MixedSync overlap answers a DC at once with its own round, as the global server would have relayed it:
    the sum of the DC's pushes (the raw kvstore's default) or that sum / all workers (reduction='mean')."""
    cluster = HipsCluster(dcs=("a", "b"), per_dc=1, mode="dist_async", mixedsync="overlap", reduction=reduction)
    try:
        kvs = cluster.init_everywhere("g", np.zeros(3, np.float32))
        assert cluster.local["a"].info["round_policy"] == "overlap"
        got = kvs[0].pushpull("g", np.full(3, 6.0, np.float32)).wait(DEADLINE_S)
        np.testing.assert_array_equal(got, np.full(3, 6.0 if reduction is None else 3.0, np.float32))
    finally:
        cluster.close()


def test_a_high_priority_round_overtakes_a_large_one_pushed_before_it_at_every_hop():
    """Issue 15 (P3's scheduled wire), end to end: each worker pushes a 2 MB key at priority 0, then a tiny key at
    priority 10. The tiny one passes the large one on the worker's queue, at the local server (its WAN push takes
    the round's priority), on each WAN link (at the next 64 KiB chunk) and in the global server's reply: it is
    answered long before the large one, whose transfer alone takes 0.84 s each way at 20 Mbit/s."""
    cluster = HipsCluster(dcs=("a", "b"), per_dc=1, link=lambda src, dst: EmulatedLink(
        name=f"{src}->{dst}", rate_bps=20e6, one_way_delay_s=0.01))
    try:
        big, small = np.zeros(512 * 1024, np.float32), np.zeros(16, np.float32)
        for key, value in (("big", big), ("small", small)):
            cluster.init_everywhere(key, value)
        done: dict[tuple[str, str], float] = {}
        start = time.monotonic()
        for dc in ("a", "b"):
            (kv,) = cluster.workers[dc]
            for key, value, priority in (("big", big + 1, 0), ("small", small + 1, 10)):
                kv.pushpull(key, value, priority=priority).add_done_callback(
                    lambda h, k=(dc, key): done.setdefault(k, time.monotonic() - start))
        end = time.monotonic() + DEADLINE_S
        while len(done) < 4 and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        cluster.close()
    assert len(done) == 4, done
    print({f"{dc}/{key}": f"{t:.2f} s" for (dc, key), t in sorted(done.items())})
    for dc in ("a", "b"):
        assert done[(dc, "big")] >= 1.6, done           # up and down the 20 Mbit/s links
        assert done[(dc, "small")] < done[(dc, "big")] / 3, done


def test_a_worker_that_does_not_set_the_masters_compression_is_told_to_where_its_parts_would_differ():
    """Parts are sized by their wire bytes, which a worker reads from its own set_gradient_compression. GeoMX
    lets workers skip the call; where the master's codec then cuts a key otherwise (top-k 1/4: parts twice as
    large), the worker is told so at its init's first reply instead of waiting for parts that never come. A key
    cut alike needs no call."""
    cluster = HipsCluster(dcs=("a", "b"), per_dc=1)
    try:
        worker = cluster.workers["a"][0]
        for kv in (cluster.master, worker):
            kv.cfg.partition_bytes = 1024
        cluster.master.set_gradient_compression({"wan": {"type": "topk", "ratio": 0.25}, "size_lower_bound": 0})
        cluster.master.init(["small", "big"], [np.zeros(100, np.float32), np.zeros(1000, np.float32)])
        expected = r"key .big.: the master.*into 2 part.*did not call kv.set_gradient_compression and cut it into 4"
        with pytest.raises(ConfigError, match=expected):
            worker.init(["small", "big"], [np.zeros(100, np.float32), np.zeros(1000, np.float32)])
    finally:
        cluster.close()


def test_a_compressed_key_is_cut_into_parts_of_its_wire_bytes_so_powersgd_sees_the_whole_matrix():
    """With parts of 1 KiB, a 64 x 64 float32 matrix (16 KiB) travels in 16 parts when dense; under PowerSGD
    rank 1 on the WAN (64 x 64 / (64 + 64) = 32 times fewer bytes) it travels whole, so the codec compresses
    the matrix, not 16 blocks of 4 rows, and the round still averages it."""
    cluster = HipsCluster(dcs=("a", "b"), per_dc=1)
    try:
        kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
        for kv in [cluster.master, *kvs]:
            kv.cfg.partition_bytes = 1024
            kv.set_gradient_compression({"wan": {"type": "powersgd", "rank": 1}, "size_lower_bound": 0})
        for kv in [cluster.master, *kvs]:
            kv.init(["m", "counts"], [np.zeros((64, 64), np.float32), np.zeros(1000, np.int32)])
        keys = set(cluster.global_server.keys)
        assert "m" in keys and not any(str(k).startswith("m#") for k in keys)
        assert "counts#0/4" in keys                          # an integer key travels as it is: raw-sized parts
        grad = np.outer(np.arange(64, dtype=np.float32), np.ones(64, np.float32))     # rank 1: exact
        for got in [h.wait(DEADLINE_S) for h in [kv.pushpull("m", grad) for kv in kvs]]:
            np.testing.assert_allclose(got, grad, rtol=1e-4, atol=1e-3)
    finally:
        cluster.close()
