"""A client's saved state, in-process (tests/scripts/inproc.py): a worker's compression streams (what
DistributedOptimizer.state_dict carries) and a local server's upstream client (which global server owns each
key, the pushes sent, the WAN streams) restore so that the next rounds are bit-identical."""
from __future__ import annotations

import numpy as np
import pytest
from inproc import DEADLINE_S, HipsCluster

from geomx import statefile
from geomx.cluster.client import KVClient
from geomx.errors import KVError

SHAPE = (8, 5)
# workers' pushes keep an error-feedback residual; a small key is compressed too
LAN_TOPK = {"lan": {"type": "topk", "ratio": 0.25}, "size_lower_bound": 1}


def _gradient(step: int, worker: int) -> np.ndarray:
    return np.random.default_rng([step, worker]).standard_normal(SHAPE).astype(np.float32)


def _cluster(**kw) -> HipsCluster:
    cluster = HipsCluster(**kw)
    kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
    for kv in (cluster.master, *kvs):
        kv.set_gradient_compression(LAN_TOPK)
    cluster.master.init("g", np.zeros(SHAPE, np.float32))
    for kv in kvs:
        kv.init("g", np.zeros(SHAPE, np.float32))
    return cluster


def _round(cluster: HipsCluster, step: int) -> list[np.ndarray]:
    kvs = [kv for kvs in cluster.workers.values() for kv in kvs]
    handles = [kv.pushpull("g", _gradient(step, i)) for i, kv in enumerate(kvs)]
    return [np.array(h.wait(DEADLINE_S)) for h in handles]


@pytest.mark.parametrize("restore", [True, False])
def test_a_workers_compression_residuals_restore_and_the_next_round_is_bit_identical(restore):
    """Two identical deployments run two rounds; in the second, worker 0 then loses its compression streams
    (a restarted worker) and, with ``restore``, gets back the first one's saved through a file. Its third round
    equals the first deployment's bit for bit; without the residuals (the control) it does not."""
    first = _cluster(dcs=("a",), per_dc=2)
    try:
        for step in (1, 2):
            _round(first, step)
        saved = statefile.loads(statefile.dumps(first.workers["a"][0].wire_state_dict()))
        ((key, shape, _, stream),) = saved["push"]
        assert key == "g" and tuple(shape) == SHAPE and np.count_nonzero(stream["feedback"]["residuals"][0]) > 0
        expected = _round(first, 3)
    finally:
        first.close()
    second = _cluster(dcs=("a",), per_dc=2)
    try:
        for step in (1, 2):
            _round(second, step)
        client = second.workers["a"][0]._client
        client.wire = None
        client._configure_compression()                   # fresh streams: no residual
        if restore:
            second.workers["a"][0].load_wire_state_dict(saved)
        got = _round(second, 3)
    finally:
        second.close()
    same = all(np.array_equal(a, b) for a, b in zip(expected, got, strict=True))
    assert same == restore


@pytest.mark.parametrize("with_upstream", [True, False])
def test_a_restored_local_server_knows_its_keys_global_owner_and_continues_bit_identically(with_upstream):
    """A local server saved after two rounds (to a file) and loaded into a server whose keys and upstream client
    are fresh serves the third round exactly as the server that went on; without the upstream client's part
    of the state it cannot send the key across the WAN, and the round fails naming the key."""
    reference = _cluster(dcs=("a", "b"), per_dc=1)
    try:
        for step in (1, 2):
            _round(reference, step)
        expected = _round(reference, 3)
    finally:
        reference.close()
    cluster = _cluster(dcs=("a", "b"), per_dc=1)
    try:
        for step in (1, 2):
            _round(cluster, step)
        server = cluster.local["a"]
        state = statefile.loads(statefile.dumps(server.state_dict()))
        if not with_upstream:
            state["config"]["upstream"] = None
        server.keys.clear()
        server.upstream = KVClient(server.po, server.global_tier)     # a fresh server's upstream client
        server.load_state_dict(state)
        if with_upstream:
            got = _round(cluster, 3)
            assert all(np.array_equal(a, b) for a, b in zip(expected, got, strict=True))
        else:
            kv = cluster.workers["a"][0]
            with pytest.raises(KVError, match=r"round 3 of key 'g' failed at .*key 'g' was never initialized"):
                kv.pushpull("g", _gradient(3, 0)).wait(DEADLINE_S)
    finally:
        cluster.close()


def test_distributed_optimizer_state_dict_carries_the_workers_compression_residuals_and_restores_them():
    """DistributedOptimizer.state_dict()["geomx"]["wire"] is the worker's compression streams; after more steps
    (new residuals) load_state_dict puts the saved ones back."""
    import threading

    import torch

    from geomx.torch import DistributedOptimizer

    cluster = HipsCluster(dcs=("a",), per_dc=1)
    try:
        (worker_kv,) = cluster.workers["a"]
        for kv in (cluster.master, worker_kv):
            kv.set_gradient_compression(LAN_TOPK)
        models = {kv: torch.nn.Linear(6, 4) for kv in (cluster.master, worker_kv)}
        opts: dict = {}

        def wrap(kv):
            opts[kv] = DistributedOptimizer(torch.optim.SGD(models[kv].parameters(), lr=0.1), models[kv],
                                            kvstore=kv)

        threads = [threading.Thread(target=wrap, args=(kv,)) for kv in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        opt, model = opts[worker_kv], models[worker_kv]

        def step(seed: int) -> None:
            opt.zero_grad()
            model(torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
            opt.step()

        step(1)
        step(2)
        saved = opt.state_dict()
        residuals = {key: stream["feedback"]["residuals"][0].copy()
                     for key, _, _, stream in saved["geomx"]["wire"]["push"]}
        assert set(residuals) == {"weight", "bias"} and all(np.count_nonzero(r) for r in residuals.values())
        step(3)
        opt.load_state_dict(saved)
        restored = {key: stream["feedback"]["residuals"][0]
                    for key, _, _, stream in worker_kv.wire_state_dict()["push"]}
        for key, residual in residuals.items():
            np.testing.assert_array_equal(restored[key], residual)
    finally:
        cluster.close()
