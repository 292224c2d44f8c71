"""dist_async (MixedSync): DCs push at their own pace; nothing is lost.

DC a (2 workers) pushes 2 rounds while DC b (1 worker) pushes 5: a synchronous server would stall DC b at its
third push. DC a's gradients touch only coordinates 0-3 of the key and DC b's only 4-7, so every value a DC
reads splits into a part that is exactly determined by its own pushes and a part that shows how much of the
other DC's pushes it has seen.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import kvhelp
from harness import check_ok, launch, load_npz

SEED = 5
SHAPE = (8,)
ROUNDS = {"a": 2, "b": 5}
WORKERS = {"a": [0, 1], "b": [2]}          # global worker indices per DC (the launcher numbers DC by DC)
N = 3
LR = 0.1
OWN = {"a": slice(0, 4), "b": slice(4, 8)}
OTHER = {"a": "b", "b": "a"}
RTT_S = 2.0         # the overlap test's WAN: long enough that one round trip dwarfs local work

COMMON = f"""
import time
import numpy as np
import geomx
import kvhelp as h

SEED, SHAPE, ROUNDS = {SEED}, {SHAPE!r}, {ROUNDS!r}

def gradient(me, dc, step):
    g = h.grad(SEED, me, step, "w", SHAPE)
    g[4:] = 0 if dc == "a" else g[4:]
    g[:4] = 0 if dc == "b" else g[:4]
    return g
"""

SERVER_OPTIMIZER_SCRIPT = COMMON + """
kv = geomx.kvstore.create(reduction="mean")
assert kv.type == "dist_async"
if kv.is_master_worker:
    kv.set_optimizer("SGD", lr=0.1)
    kv.init("w", h.value(0, "w", SHAPE))
    # when every worker has finished pushing, read the global servers' weights
    for i in range(kv.num_all_workers):
        h.wait_for_file(h.run_dir() / f"done-{i}.json")
    h.save("final", {"w": kv.pull("w").wait()})
    h.dump("final-read", True)
    raise SystemExit(0)
kv.init("w", np.zeros(SHAPE, np.float32))
me = h.worker_index()
reads = [kv.pushpull("w", gradient(me, kv.dc, step)).wait() for step in range(ROUNDS[kv.dc])]
h.save(f"reads-{me}", {"reads": np.stack(reads)})
h.dump(f"done-{me}", kv.dc)
h.wait_for_file(h.run_dir() / "final-read.json")     # keep the deployment up until the master has read
"""

RELAY_SCRIPT = COMMON + """
kv = geomx.kvstore.create(reduction="mean")
kv.init("w", np.zeros(SHAPE, np.float32))
if kv.is_master_worker:
    raise SystemExit(0)
me = h.worker_index()
reads = [kv.pushpull("w", gradient(me, kv.dc, step)).wait() for step in range(ROUNDS[kv.dc])]
kv.barrier(global_=True)                  # every DC has pushed everything ...
reads.append(kv.pushpull("w", np.zeros(SHAPE, np.float32)).wait())   # ... so this read collects the rest
h.save(f"reads-{me}", {"reads": np.stack(reads)})
"""

# MixedSync overlap: the local server answers each round at once, so after the last push the other DC's last
# gradients may still be on the WAN; read (pushing zeros) until they are all here. Both workers of a DC read
# the same values, so they stop after the same round (a deadline could split them: one round short, a hang).
OVERLAP_SCRIPT = RELAY_SCRIPT.split("reads = [")[0] + f"""
started = time.perf_counter()
reads = [kv.pushpull("w", gradient(me, kv.dc, step)).wait() for step in range(ROUNDS[kv.dc])]
h.dump(f"rounds-s-{{me}}", time.perf_counter() - started)
kv.barrier(global_=True)
WORKERS, N = {WORKERS!r}, {N}
other = "b" if kv.dc == "a" else "a"
theirs = slice(4, 8) if other == "b" else slice(0, 4)
expected = sum(gradient(w, other, step) for w in WORKERS[other] for step in range(ROUNDS[other]))[theirs] / N
for _ in range(400):
    if np.allclose(np.sum(reads, axis=0)[theirs], expected, rtol=0, atol=1e-5):
        break
    time.sleep(0.05)
    reads.append(kv.pushpull("w", np.zeros(SHAPE, np.float32)).wait())
h.save(f"reads-{{me}}", {{"reads": np.stack(reads)}})
"""


def gradient(me: int, dc: str, step: int) -> np.ndarray:
    g = kvhelp.grad(SEED, me, step, "w", SHAPE).astype(np.float64)
    other = OWN[OTHER[dc]]
    g[other] = 0
    return g


def dc_round_sum(dc: str, step: int) -> np.ndarray:
    return sum(gradient(me, dc, step) for me in WORKERS[dc])


def dc_prefix_sums(dc: str) -> list[np.ndarray]:
    """Sum of the DC's first j rounds, j = 0..ROUNDS[dc]."""
    sums = [np.zeros(SHAPE)]
    for step in range(ROUNDS[dc]):
        sums.append(sums[-1] + dc_round_sum(dc, step))
    return sums


@pytest.fixture(scope="module")
def server_optimizer_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async-sgd")
    return check_ok(launch(tmp, SERVER_OPTIMIZER_SCRIPT, dcs=2, workers_per_dc=[2, 1], mode="dist_async"))


def test_async_server_sgd_each_read_reflects_exactly_the_own_dcs_pushes(server_optimizer_run):
    w0 = kvhelp.value(0, "w", SHAPE).astype(np.float64)
    for dc, members in WORKERS.items():
        own, prefix = OWN[dc], dc_prefix_sums(dc)
        for me in members:
            reads = load_npz(server_optimizer_run, f"reads-{me}")["reads"]
            assert reads.shape == (ROUNDS[dc],) + SHAPE
            for step in range(ROUNDS[dc]):
                expected = w0[own] - LR / N * prefix[step + 1][own]
                np.testing.assert_allclose(reads[step][own], expected, rtol=0, atol=1e-6,
                                           err_msg=f"DC {dc} worker {me} read {step}")
            # the weights moved after every push of this DC
            assert all(np.abs(reads[s][own] - reads[s - 1][own]).min() > 0 for s in range(1, ROUNDS[dc]))


def test_async_server_sgd_reads_show_the_other_dcs_pushes_as_a_growing_prefix(server_optimizer_run):
    w0 = kvhelp.value(0, "w", SHAPE).astype(np.float64)
    for dc, members in WORKERS.items():
        other = OWN[OTHER[dc]]
        candidates = [w0[other] - LR / N * p[other] for p in dc_prefix_sums(OTHER[dc])]
        for me in members:
            reads = load_npz(server_optimizer_run, f"reads-{me}")["reads"]
            seen = []
            for r in reads:
                matches = [j for j, c in enumerate(candidates) if np.allclose(r[other], c, rtol=0, atol=1e-6)]
                assert matches, f"DC {dc} worker {me} read {r[other]}: not w0 minus a prefix of DC " \
                                f"{OTHER[dc]}'s pushes"
                seen.append(matches[0])
            assert seen == sorted(seen), f"DC {dc} saw DC {OTHER[dc]}'s pushes go backwards: {seen}"


def test_async_server_sgd_applies_every_push_of_every_dc_once(server_optimizer_run):
    w0 = kvhelp.value(0, "w", SHAPE).astype(np.float64)
    total = dc_prefix_sums("a")[-1] + dc_prefix_sums("b")[-1]
    final = load_npz(server_optimizer_run, "final")["w"]
    np.testing.assert_allclose(final, w0 - LR / N * total, rtol=0, atol=1e-6)


def test_async_worker_side_every_gradient_reaches_every_dc_exactly_once(tmp_path):
    """Without a server optimizer each read returns the gradients applied since the DC's last read, divided
    by all workers: own pushes come back in the read that follows them, the other DC's arrive exactly once."""
    run_dir = check_ok(launch(tmp_path, RELAY_SCRIPT, dcs=2, workers_per_dc=[2, 1], mode="dist_async"))
    everything = (dc_prefix_sums("a")[-1] + dc_prefix_sums("b")[-1]) / N
    for dc, members in WORKERS.items():
        own = OWN[dc]
        for me in members:
            reads = load_npz(run_dir, f"reads-{me}")["reads"].astype(np.float64)
            assert reads.shape == (ROUNDS[dc] + 1,) + SHAPE
            for step in range(ROUNDS[dc]):
                np.testing.assert_allclose(reads[step][own], dc_round_sum(dc, step)[own] / N, rtol=0, atol=1e-6,
                                           err_msg=f"DC {dc} worker {me} read {step}")
            np.testing.assert_array_equal(reads[-1][own], 0)
            np.testing.assert_allclose(reads.sum(axis=0), everything, rtol=0, atol=1e-5,
                                       err_msg=f"DC {dc} worker {me}: the reads do not add up to every gradient")
        # both workers of a DC read the same values (one local server answers them)
        if len(members) == 2:
            np.testing.assert_array_equal(load_npz(run_dir, f"reads-{members[0]}")["reads"],
                                          load_npz(run_dir, f"reads-{members[1]}")["reads"])


def test_mixedsync_overlap_answers_own_gradients_at_once_and_delivers_every_other_dcs_exactly_once(tmp_path):
    """GEOMX_MIXEDSYNC=overlap: the local server answers a round without waiting for the WAN, with the DC's own
    round sum (/ all workers) and whatever the other DC's pushes have arrived; its own pushes never come back
    from the global server, and every other DC's gradient arrives exactly once."""
    run_dir = check_ok(launch(tmp_path, OVERLAP_SCRIPT, dcs=2, workers_per_dc=[2, 1], mode="dist_async",
                              mixedsync="overlap", wan_rate="1gbit", wan_rtt=f"{RTT_S * 1000:.0f}ms"))
    everything = (dc_prefix_sums("a")[-1] + dc_prefix_sums("b")[-1]) / N
    for dc, members in WORKERS.items():
        own = OWN[dc]
        for me in members:
            # waiting for the WAN, DC b's 5 rounds would take 5 round trips; they take less than one
            rounds_s = json.loads((run_dir / f"rounds-s-{me}.json").read_text())
            assert rounds_s < RTT_S, (dc, me, rounds_s)
            reads = load_npz(run_dir, f"reads-{me}")["reads"].astype(np.float64)
            assert len(reads) > ROUNDS[dc]
            for step in range(ROUNDS[dc]):
                np.testing.assert_allclose(reads[step][own], dc_round_sum(dc, step)[own] / N, rtol=0, atol=1e-6,
                                           err_msg=f"DC {dc} worker {me} read {step}")
            np.testing.assert_array_equal(reads[ROUNDS[dc]:, own], 0)       # zeros pushed, nothing echoed
            np.testing.assert_allclose(reads.sum(axis=0), everything, rtol=0, atol=1e-5,
                                       err_msg=f"DC {dc} worker {me}: the reads do not add up to every gradient")
        if len(members) == 2:
            np.testing.assert_array_equal(load_npz(run_dir, f"reads-{members[0]}")["reads"],
                                          load_npz(run_dir, f"reads-{members[1]}")["reads"])


OVERLAP_OPTIMIZER_SCRIPT = """
import geomx
import kvhelp as h
import numpy as np

kv = geomx.kvstore.create(reduction="mean")
if kv.is_master_worker:
    try:
        kv.set_optimizer("SGD", lr=0.1)
        h.dump("refusal", None)
    except geomx.GeomxError as exc:
        h.dump("refusal", str(exc))
kv.init("w", np.zeros(3, np.float32))    # without the optimizer the deployment still runs
if not kv.is_master_worker:
    kv.pushpull("w", np.ones(3, np.float32)).wait()
"""


def test_mixedsync_overlap_refuses_a_server_optimizer_saying_why(tmp_path):
    run_dir = check_ok(launch(tmp_path, OVERLAP_OPTIMIZER_SCRIPT, dcs=2, workers_per_dc=1, mode="dist_async",
                              mixedsync="overlap"))
    refusal = json.loads((run_dir / "refusal.json").read_text())
    assert refusal is not None and "overlap" in refusal and "server optimizer" in refusal, refusal
