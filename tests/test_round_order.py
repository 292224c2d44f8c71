"""A round's sum does not depend on the order its pushes arrive in: the flat parameter server (four workers
push to one server) and a DC of three workers end on the same numbers whichever push came first, so the flat
PS trains the very model HiPS FSA trains from the same seed, run after run.

The pushes are chosen so that float32 sums in different orders differ: 1e8 + 1 - 1e8 + 0.5 is 0.5 summed in
one order and 0 in the reverse one; the exact sum is 1.5. Deployments run in this process (tests/scripts/inproc.py).
"""
from __future__ import annotations

import time

import numpy as np
from inproc import FlatCluster, HipsCluster

from geomx.cluster.kvserver import Round

WAIT_S = 60      # deadlines only
PUSHES = [np.array([1e8, 3.0, 1.0], np.float32), np.array([1.0, 1e-3, 1e7], np.float32),
          np.array([-1e8, -3.0, -1e7], np.float32), np.array([0.5, 7e-4, 2.0], np.float32)]


def _exact_sum(values) -> np.ndarray:
    return np.sum(np.array(values, dtype=np.float64), axis=0).astype(np.float32)


def test_a_round_of_three_or_more_pushes_sums_the_same_in_every_order_and_two_keep_the_float32_sum():
    assert not np.array_equal(PUSHES[0] + PUSHES[1] + PUSHES[2] + PUSHES[3],
                              PUSHES[3] + PUSHES[2] + PUSHES[1] + PUSHES[0])      # float32 order matters here
    sums = []
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        rnd = Round(order_free=True)
        for i in order:
            rnd.add(f"w{i}", PUSHES[i].copy(), 0, reusable=True)
        sums.append(rnd.finish().total)
    for s in sums:
        assert s.dtype == np.float32
        np.testing.assert_array_equal(s, _exact_sum(PUSHES))
    pair = Round()
    pair.add("a", PUSHES[0], 0)
    pair.add("b", PUSHES[1], 0)
    assert pair.finish().total.dtype == np.float32
    np.testing.assert_array_equal(pair.total, PUSHES[0] + PUSHES[1])
    # a round saved half-way goes on summing in float64 and narrows when it completes
    half = Round(order_free=True)
    for i in (0, 1):
        half.add(f"w{i}", PUSHES[i], 0)
    again = Round.from_state_dict(half.state_dict())
    for i in (2, 3):
        again.add(f"w{i}", PUSHES[i], 0)
    np.testing.assert_array_equal(again.finish().total, _exact_sum(PUSHES))


def _push_in_order(kvs, order, key) -> list[np.ndarray]:
    handles = {}
    for i in order:                      # one after the other, so that they arrive in this order
        handles[i] = kvs[i].pushpull(key, PUSHES[i].copy())
        time.sleep(0.05)
    return [np.array(handles[i].wait(WAIT_S)) for i in range(len(kvs))]


def test_the_flat_servers_round_of_four_workers_is_the_same_whichever_push_arrives_first():
    cluster = FlatCluster(num_workers=4)
    try:
        master = cluster.master.kv
        for h in master.command("set_mode", mode="dist_sync", mixedsync="wait", reduction="sum"):
            h.wait(WAIT_S)
        master.init("g", np.zeros(3, np.float32)).wait(WAIT_S)
        kvs = [w.kv for w in cluster.workers]
        for kv in kvs:
            kv.init_layout("g", (3,), np.float32).wait(WAIT_S)
        forward = _push_in_order(kvs, [0, 1, 2, 3], "g")
        backward = _push_in_order(kvs, [3, 2, 1, 0], "g")
    finally:
        cluster.close()
    for got in forward + backward:
        np.testing.assert_array_equal(got, _exact_sum(PUSHES))


def test_a_dc_of_three_workers_sums_the_same_whichever_push_arrives_first():
    cluster = HipsCluster(dcs=("a",), per_dc=3, reduction=None)
    try:
        kvs = cluster.init_everywhere("g", np.zeros(3, np.float32))
        results = _push_in_order(kvs, [0, 1, 2], "g") + _push_in_order(kvs, [2, 1, 0], "g")
    finally:
        cluster.close()
    for got in results:
        np.testing.assert_array_equal(got, _exact_sum(PUSHES[:3]))
