"""A server's whole state saves and restores: a global server saved mid-training and loaded into a fresh one
(in a second deployment whose nodes have the same ids) answers the next rounds bit for bit as the original.

Deployments run in this process (tests/scripts/inproc.py): real schedulers, server and clients over the
in-memory van. Each case takes about a second once torch has made its first optimizer.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from inproc import FlatCluster

from geomx import statefile
from geomx.compression import parse_policy

KEYS = {"w": (64,), 7: (8, 4)}
WAIT_S = 60      # deadlines only: a loaded 2-core machine may be slow, never wrong


@pytest.fixture(scope="module", autouse=True)
def _torch_optimizers_loaded():
    """A first torch optimizer loads torch._dynamo (seconds on a loaded machine): do it here, not on the
    server's receive thread inside a deadline (run_global_server imports torch first for the same reason)."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)]).step()

TOPK = {"wan": {"type": "topk", "ratio": 0.25}, "size_lower_bound": 0}


def _grad(step: int, worker: int, shape) -> np.ndarray:
    return np.random.default_rng([step, worker]).standard_normal(shape).astype(np.float32)


def _rounds(cluster: FlatCluster, steps: range, synchronous: bool) -> list[np.ndarray]:
    """Every worker pushes each key's gradient and reads the result back (all at once in dist_sync; one worker
    after the other in dist_async, so the order is fixed)."""
    results = []
    for step in steps:
        for key, shape in KEYS.items():
            handles = []
            for i, w in enumerate(cluster.workers):
                handles.append(w.kv.pushpull(key, _grad(step, i, shape)))
                if not synchronous:
                    results.append(np.array(handles.pop().wait(WAIT_S)))
            results.extend(np.array(h.wait(WAIT_S)) for h in handles)
    return results


def _configure(cluster: FlatCluster, mode: str, optimizer, compression) -> None:
    master = cluster.master.kv
    for h in master.command("set_mode", mode=mode, mixedsync="wait", reduction="mean"):
        h.wait(WAIT_S)
    if optimizer is not None:
        for h in master.command("set_optimizer", optimizer=optimizer[0], kwargs=optimizer[1]):
            h.wait(WAIT_S)
    if compression is not None:
        for h in master.command("set_compression", policy=parse_policy(compression).to_wire()):
            h.wait(WAIT_S)
    for key, shape in KEYS.items():
        master.init(key, np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape)).wait(WAIT_S)


def _join_keys(cluster: FlatCluster) -> None:
    for w in cluster.workers:
        for key, shape in KEYS.items():
            w.kv.init_layout(key, shape, np.float32).wait(WAIT_S)


CASES = {
    # Adam's moments and step, a top-k stream with a residual per client, the weights each client holds
    "adam+topk": ("dist_sync", ("torch.optim.Adam", {"lr": 0.05}), TOPK),
    # the round's mean gradient encoded once, with its residual
    "mean+topk": ("dist_sync", None, TOPK),
    # dist_async relay: every client's unread gradients
    "relay": ("dist_async", None, None),
    # DCASGD keeps one weight backup per sender (the DC whose push is applied)
    "dcasgd": ("dist_async", ("geomx.optim.DCASGD", {"lr": 0.1, "momentum": 0.5, "lamda": 0.5}), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_global_server_restored_from_its_saved_state_continues_bit_for_bit(case, tmp_path):
    mode, optimizer, compression = CASES[case]
    synchronous = mode == "dist_sync"
    first = FlatCluster()
    try:
        _configure(first, mode, optimizer, compression)
        _join_keys(first)
        _rounds(first, range(3), synchronous)
        first.server.save(tmp_path / "server.state")
        client_wires = [copy.deepcopy(w.kv.wire) for w in first.workers]
        expected = _rounds(first, range(3, 6), synchronous)
    finally:
        first.close()

    second = FlatCluster()
    try:
        second.server.load(tmp_path / "server.state")
        _join_keys(second)
        for w, wire in zip(second.workers, client_wires, strict=True):
            w.kv.wire = wire                     # the workers' own codec memory, as it was at the save
        got = _rounds(second, range(3, 6), synchronous)
    finally:
        second.close()
    assert len(got) == len(expected) == 3 * len(KEYS) * 2
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)
    # the saved rounds moved the values: a restore that lost the state could not match by accident
    assert not all(np.array_equal(a, np.zeros_like(a)) for a in expected)


@pytest.mark.parametrize("with_residuals", [True, False])
def test_a_global_servers_checkpoint_carries_its_reply_codecs_residual_and_a_resumed_job_goes_on_bit_for_bit(
        with_residuals, tmp_path):
    """Unlike a whole saved state, a checkpoint (server_checkpoint.py) is resumed by new processes: the global
    server's checkpoint of round 3 keeps each key's reply stream (top-k, its error-feedback residual), the
    workers' checkpoints their push streams. Resumed from both, rounds 4-6 answer exactly as in the job that went
    on; with the residual left out of the checkpoint (the control) they do not."""
    first = FlatCluster(global_server_fields={"checkpoint_every": 3, "checkpoint_dir": str(tmp_path)})
    try:
        _configure(first, "dist_sync", None, TOPK)
        _join_keys(first)
        _rounds(first, range(3), True)
        worker_wires = [statefile.loads(statefile.dumps(w.kv.wire_state_dict())) for w in first.workers]
        expected = _rounds(first, range(3, 6), True)
    finally:
        first.close()
    checkpoint = tmp_path / "global-server-0-round-3.state"
    saved = statefile.load(checkpoint)
    assert all(np.count_nonzero(entry["wire"]["down"]["feedback"]["residuals"][0]) for entry in saved["keys"])
    if not with_residuals:
        statefile.save(checkpoint, {**saved, "keys": [{**entry, "wire": None} for entry in saved["keys"]]})

    second = FlatCluster(global_server_fields={"resume_from": str(tmp_path), "resume_step": 3})
    try:
        _configure(second, "dist_sync", None, TOPK)
        _join_keys(second)
        for w, wire in zip(second.workers, worker_wires, strict=True):
            w.kv.load_wire_state_dict(wire)
        got = _rounds(second, range(3, 6), True)
    finally:
        second.close()
    assert all(np.array_equal(a, b) for a, b in zip(expected, got, strict=True)) == with_residuals


def test_a_state_file_keeps_arrays_tuples_and_generator_states_and_refuses_other_files(tmp_path):
    rng = np.random.default_rng(5)
    state = {"value": np.arange(6, dtype=np.float16).reshape(2, 3), 3: ("a", 1), "rng": rng.bit_generator.state}
    statefile.save(tmp_path / "s", state)
    back = statefile.load(tmp_path / "s")
    assert back[3] == ("a", 1) and back["rng"] == rng.bit_generator.state
    assert back["value"].dtype == np.float16 and back["value"].flags.writeable
    np.testing.assert_array_equal(back["value"], state["value"])
    (tmp_path / "junk").write_bytes(b"\x93\x01\x02\x03")
    with pytest.raises(Exception, match="not a geomx state file"):
        statefile.load(tmp_path / "junk")


def test_a_state_cannot_be_loaded_into_a_server_of_another_kind_or_one_with_keys(tmp_path):
    cluster = FlatCluster(num_workers=1)
    try:
        _configure(cluster, "dist_sync", None, None)
        state = cluster.server.state_dict()
        with pytest.raises(Exception, match="already has keys"):
            cluster.server.load_state_dict(state)
        with pytest.raises(Exception, match="LocalServer state cannot be loaded into a GlobalServer"):
            cluster.server.load_state_dict({**state, "server": "LocalServer"})
    finally:
        cluster.close()


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_local_servers_state_survives_a_file_and_a_fresh_server(tmp_path):
    """A 2-DC run (in-memory van) with ordinary and DC-only rounds under top-k: the local server's state, saved
    to a file and loaded into a fresh LocalServer, is the same state (values, counters, WAN rounds, codec memory,
    DC-round counts)."""
    from inproc import HipsCluster

    from geomx.cluster.local_server import LocalServer
    from geomx.cluster.postoffice import Postoffice

    cluster = HipsCluster(dcs=("a", "b"), per_dc=1)
    try:
        topk = {"type": "topk", "ratio": 0.25}
        cluster.master.set_gradient_compression({"lan": topk, "wan": topk, "size_lower_bound": 0})
        cluster.master.init("w", np.zeros(16, np.float32))
        kvs = [cluster.workers[dc][0] for dc in ("a", "b")]
        for kv in kvs:
            kv.init("w", np.zeros(16, np.float32))
        for step in range(3):
            handles = [kv.pushpull("w", _grad(step, i, (16,))) for i, kv in enumerate(kvs)]
            handles += [kv.pushpull("w", np.ones(16, np.float32), scope="dc") for kv in kvs]
            for h in handles:
                h.wait(WAIT_S)
        server = cluster.local["a"]
        server.save(tmp_path / "local.state")
        saved = server.state_dict()
        fresh = LocalServer(Postoffice(cluster.config(role="server", dc="a")))
        fresh.load(tmp_path / "local.state")
    finally:
        cluster.close()
    again = fresh.state_dict()
    assert saved["keys"][0]["upstream"]["applied_rounds"] == 3 and saved["keys"][0]["wire"] is not None
    assert saved["config"]["dc_rounds"]["counts"]
    assert _same(saved, again)


def test_a_worker_pushing_on_alone_is_refused_past_the_open_round_cap_and_the_rounds_then_complete():
    """A member that pushes without the others (a stuck peer, a script that never pulls, a hostile member)
    opens at most MAX_OPEN_ROUNDS rounds, each holding a copy of the key; its next push is refused by name.
    The other worker then completes every open round, and the results are the exact means."""
    from geomx.cluster.kvserver import MAX_OPEN_ROUNDS
    from geomx.errors import KVError

    cluster = FlatCluster()
    try:
        _configure(cluster, "dist_sync", None, None)
        _join_keys(cluster)
        eager, late = (w.kv for w in cluster.workers)
        ones = np.ones(KEYS["w"], np.float32)
        for _ in range(MAX_OPEN_ROUNDS):
            eager.push("w", ones).wait(WAIT_S)
        with pytest.raises(KVError, match=rf"push of key 'w' from .* refused: {MAX_OPEN_ROUNDS} rounds of this key "
                                          rf"already wait"):
            eager.push("w", ones).wait(WAIT_S)
        assert len(cluster.server.keys["w"].rounds) == MAX_OPEN_ROUNDS
        for _ in range(MAX_OPEN_ROUNDS):
            late.push("w", 3 * ones).wait(WAIT_S)
        np.testing.assert_array_equal(eager.pull("w").wait(WAIT_S), 2 * ones)     # the mean of 1 and 3
        assert cluster.server.keys["w"].rounds == {}
    finally:
        cluster.close()


@pytest.mark.parametrize("algorithm,saves", [("fsa", True), ("hfa", False)])
def test_the_global_servers_learn_from_the_master_worker_whether_its_steps_are_rounds(tmp_path, monkeypatch,
                                                                                       algorithm, saves):
    """A synchronization algorithm chosen in code (sync=HFA(...)), the environment naming none: the master worker's
    mode tells the global servers whether a step is one round, so that a server with compressed replies checkpoints
    its rounds under FSA (round N is step N) and not under HFA, whose rounds name no step the workers saved (before,
    the servers took every job without GEOMX_SYNC for FSA, and an HFA job's resume asked for files of rounds that
    were no steps)."""
    from inproc import HipsCluster

    from geomx.sync import create as create_sync

    monkeypatch.delenv("GEOMX_SYNC", raising=False)
    cluster = HipsCluster(dcs=("a", "b"), per_dc=1, global_server_fields={"checkpoint_every": 2,
                                                                         "checkpoint_dir": str(tmp_path)})
    try:
        cluster.master.claim_sync(create_sync(algorithm))
        cluster.master.set_gradient_compression(TOPK)
        kvs = cluster.init_everywhere("w", np.zeros(16, np.float32))
        for step in range(4):
            for h in [kv.pushpull("w", _grad(step, i, (16,))) for i, kv in enumerate(kvs)]:
                h.wait(WAIT_S)
        assert cluster.global_server.rounds_are_steps is saves
    finally:
        cluster.close()
    assert bool(list(tmp_path.glob("global-server-0-round-*"))) is saves, sorted(tmp_path.iterdir())
