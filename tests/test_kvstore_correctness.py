"""End-to-end correctness of the synchronous (FSA, dist_sync) kvstore on real deployments.

Each module-scoped run starts a whole deployment (schedulers, local servers, global servers, master worker,
2 DCs x 2 workers) as real processes over real sockets; the training script saves what every worker pulled
and the tests recompute the expected numbers from the same deterministic gradients (tests/scripts/kvhelp.py).
"""
from __future__ import annotations

import numpy as np
import pytest

import kvhelp
from harness import check_ok, launch, load_json, load_npz

SEED = 1234
KEYS = {0: (3,), 1: (64, 33), "fc.weight": (5, 7), "big": (20000,), 7: (1,)}
INT_KEY, INT_SHAPE = "ints", (6,)          # integer-valued gradients: every summation order is exact
STEPS = 4
DCS, PER_DC = 2, 2
N = DCS * PER_DC

FSA_SCRIPT = f"""
import time
import numpy as np
import geomx
import kvhelp as h

SEED, STEPS = {SEED}, {STEPS}
KEYS = {KEYS!r}
INT_KEY, INT_SHAPE = {INT_KEY!r}, {INT_SHAPE!r}

kv = geomx.kvstore.create(reduction="mean")
me = h.worker_index()
name = "master" if kv.is_master_worker else f"w{{me}}"
h.dump(f"props-{{name}}", {{"rank": kv.rank, "num_workers": kv.num_workers, "num_all_workers": kv.num_all_workers,
                         "is_master_worker": kv.is_master_worker, "dc": kv.dc, "type": kv.type}})

# the master initializes with value A (tag 0); every worker with its own B_i (tag me + 1)
tag = 0 if kv.is_master_worker else me + 1
keys = list(KEYS)
kv.init(keys[:2], [h.value(tag, k, KEYS[k]) for k in keys[:2]])       # list form
for k in keys[2:]:
    kv.init(k, h.value(tag, k, KEYS[k]))                              # one key at a time
kv.init(INT_KEY, np.full(INT_SHAPE, float(tag), np.float32))
if kv.is_master_worker:
    h.dump("owners", [[repr(k), r] for k, r in kv._client._owner.items()])
    raise SystemExit(0)

start = {{k: np.zeros(s, np.float32) for k, s in KEYS.items()}}
for handle in kv.pull(keys, out=[start[k] for k in keys]):
    handle.wait()
start[INT_KEY] = kv.pull(INT_KEY).wait()
h.save(f"start-{{me}}", {{repr(k): v for k, v in start.items()}})

# barriers: a late worker holds back the others (the DC barrier: rank 1 of each DC; the global one: worker N-1)
if kv.rank == 1:
    time.sleep(0.5)
dc_enter = time.time(); kv.barrier(); dc_exit = time.time()
if me == kv.num_all_workers - 1:
    time.sleep(0.5)
g_enter = time.time(); kv.barrier(global_=True); g_exit = time.time()
h.dump(f"barrier-{{me}}", {{"dc": kv.dc, "dc_enter": dc_enter, "dc_exit": dc_exit, "g_enter": g_enter,
                          "g_exit": g_exit}})

results = {{}}
for step in range(STEPS):
    g = {{k: h.grad(SEED, me, step, k, s) for k, s in KEYS.items()}}
    g[INT_KEY] = h.grad(SEED, me, step, INT_KEY, INT_SHAPE, integer=True)
    names = list(g)
    out = {{k: np.zeros_like(v) for k, v in g.items()}}
    if step == 0:      # pushpull one key at a time, result returned by wait()
        for k in names:
            out[k] = kv.pushpull(k, g[k]).wait()
    elif step == 1:    # list-form pushpull, every key in flight at once, results copied into out
        for handle in kv.pushpull(names, [g[k] for k in names], out=[out[k] for k in names]):
            handle.wait()
    elif step == 2:    # list-form push, then single-key pulls with no wait in between
        kv.push(names, [g[k] for k in names])
        for k in names:
            kv.pull(k, out=out[k])
        kv.waitall()
    else:              # single-key pushes, then one list-form pull, no wait in between
        for k in names:
            kv.push(k, g[k])
        kv.pull(names, out=[out[k] for k in names])
        kv.waitall()
    for k in names:
        results[f"{{k!r}}@{{step}}"] = out[k]
h.save(f"fsa-{{me}}", results)
"""


def all_keys() -> dict:
    return {**KEYS, INT_KEY: INT_SHAPE}


def gradient(index: int, step: int, key) -> np.ndarray:
    if key == INT_KEY:
        return kvhelp.grad(SEED, index, step, key, INT_SHAPE, integer=True)
    return kvhelp.grad(SEED, index, step, key, KEYS[key])


def hierarchical_mean(step: int, key) -> np.ndarray:
    """What HiPS computes, in float32 and in its order: each DC sums its 2 workers, the global server sums the
    2 DC sums and divides by all 4 workers (sums of two terms are commutative, hence exact)."""
    dc_sums = [gradient(d * PER_DC, step, key) + gradient(d * PER_DC + 1, step, key) for d in range(DCS)]
    return (dc_sums[0] + dc_sums[1]) / np.float32(N)


def true_mean(step: int, key) -> np.ndarray:
    return np.mean([gradient(i, step, key).astype(np.float64) for i in range(N)], axis=0)


def _run(tmp_path_factory, name: str, **kw):
    tmp = tmp_path_factory.mktemp(name)
    return check_ok(launch(tmp, FSA_SCRIPT, dcs=DCS, workers_per_dc=PER_DC, timeout=90, **kw))


@pytest.fixture(scope="module")
def hips_g1(tmp_path_factory):
    return _run(tmp_path_factory, "hips-g1", global_servers=1)


@pytest.fixture(scope="module")
def hips_g2(tmp_path_factory):
    return _run(tmp_path_factory, "hips-g2", global_servers=2)


@pytest.fixture(scope="module")
def hips_g2_parts(tmp_path_factory):
    """Tensors above 16 KiB travel in parts: "big" (80 000 bytes) as 5 parts of <= 16 384 bytes."""
    return _run(tmp_path_factory, "hips-g2-parts", global_servers=2, env={"GEOMX_PARTITION_BYTES": "16384"})


@pytest.fixture(scope="module")
def flat_g2(tmp_path_factory):
    return _run(tmp_path_factory, "flat-g2", global_servers=2, topology="flat")


@pytest.mark.parametrize("run", ["hips_g1", "hips_g2", "hips_g2_parts"])
def test_fsa_pushpull_equals_exact_mean_of_every_workers_gradient_across_dcs(run, request):
    run_dir = request.getfixturevalue(run)
    for me in range(N):
        got = load_npz(run_dir, f"fsa-{me}")
        assert len(got) == STEPS * len(all_keys())
        for step in range(STEPS):
            for key, shape in all_keys().items():
                value = got[f"{key!r}@{step}"]
                assert value.shape == shape and value.dtype == np.float32, (me, step, key)
                np.testing.assert_array_equal(value, hierarchical_mean(step, key),
                                              err_msg=f"worker {me}, step {step}, key {key!r}")
                np.testing.assert_allclose(value, true_mean(step, key), rtol=1e-5, atol=1e-6)


def test_two_global_servers_share_the_keys_each_key_whole_on_the_emptiest_server(hips_g2):
    owners = dict((k, r) for k, r in load_json(hips_g2, "owners"))
    assert set(owners) == {repr(k) for k in all_keys()}
    assert set(owners.values()) == {0, 1}, "a second global server that owns no key is not tested"
    # placed whole, each on the server with the fewest bytes so far: once the 80 kB key sits on one server,
    # the keys initialized after it go to the other one
    later = [repr(k) for k in list(all_keys())[list(all_keys()).index("big") + 1:]]
    assert later and all(owners[k] != owners[repr("big")] for k in later), owners


def test_a_tensor_above_partition_bytes_travels_as_parts_spread_over_both_global_servers(hips_g2_parts):
    owners = dict((k, r) for k, r in load_json(hips_g2_parts, "owners"))
    parts = sorted(k for k in owners if k.startswith("'big#"))
    assert parts == [f"'big#{i}/5'" for i in range(5)], owners
    assert {owners[k] for k in parts} == {0, 1}, "all parts of one tensor landed on one server"
    assert "'big'" not in owners and "'fc.weight'" in owners    # small keys stay whole


def test_flat_topology_pushpull_equals_mean_of_every_workers_gradient(flat_g2):
    for me in range(N):
        got = load_npz(flat_g2, f"fsa-{me}")
        for step in range(STEPS):
            for key in all_keys():
                np.testing.assert_allclose(got[f"{key!r}@{step}"], true_mean(step, key), rtol=1e-5, atol=1e-6,
                                           err_msg=f"worker {me}, step {step}, key {key!r}")


def test_flat_and_hips_give_identical_results_for_identical_gradients(hips_g2, flat_g2):
    for me in range(N):
        hips, flat = load_npz(hips_g2, f"fsa-{me}"), load_npz(flat_g2, f"fsa-{me}")
        assert hips.keys() == flat.keys()
        for name in hips:
            if name.startswith(repr(INT_KEY)):
                # exact sums: the two topologies must agree bit for bit
                np.testing.assert_array_equal(hips[name], flat[name], err_msg=name)
            else:
                # float32 sums in a different order (per DC, then across DCs): equal up to rounding
                np.testing.assert_allclose(hips[name], flat[name], rtol=1e-6, atol=1e-6, err_msg=name)
        hips_start, flat_start = load_npz(hips_g2, f"start-{me}"), load_npz(flat_g2, f"start-{me}")
        assert hips_start.keys() == flat_start.keys()
        for name in hips_start:
            np.testing.assert_array_equal(hips_start[name], flat_start[name], err_msg=name)


@pytest.mark.parametrize("run", ["hips_g2", "flat_g2", "hips_g2_parts"])
def test_every_worker_starts_from_the_master_workers_values(run, request):
    run_dir = request.getfixturevalue(run)
    for me in range(N):
        start = load_npz(run_dir, f"start-{me}")
        for key, shape in KEYS.items():
            np.testing.assert_array_equal(start[repr(key)], kvhelp.value(0, key, shape),
                                          err_msg=f"worker {me} key {key!r} does not hold the master's value")
            assert not np.array_equal(start[repr(key)], kvhelp.value(me + 1, key, shape))
        np.testing.assert_array_equal(start[repr(INT_KEY)], np.zeros(INT_SHAPE, np.float32))


def test_push_then_immediate_pull_returns_the_value_after_the_round(hips_g2):
    """Steps 2 and 3 push every key and pull it right away without waiting: each pull must see its round."""
    for me in range(N):
        got = load_npz(hips_g2, f"fsa-{me}")
        for step in (2, 3):
            for key in all_keys():
                value = got[f"{key!r}@{step}"]
                np.testing.assert_array_equal(value, hierarchical_mean(step, key))
                assert not np.array_equal(value, hierarchical_mean(step - 1, key)), "pull returned a stale round"


def test_kvstore_properties_name_rank_dc_and_worker_counts(hips_g2):
    master = load_json(hips_g2, "props-master")
    assert master == {"rank": 0, "num_workers": 1, "num_all_workers": N, "is_master_worker": True,
                      "dc": "central", "type": "dist_sync"}
    seen = set()
    for me in range(N):
        props = load_json(hips_g2, f"props-w{me}")
        dc, rank = "ab"[me // PER_DC], me % PER_DC      # the launcher numbers workers DC by DC
        assert props == {"rank": rank, "num_workers": PER_DC, "num_all_workers": N, "is_master_worker": False,
                         "dc": dc, "type": "dist_sync"}
        seen.add((dc, rank))
    assert len(seen) == N


@pytest.mark.parametrize("run", ["hips_g2", "flat_g2"])
def test_barriers_release_nobody_before_the_last_worker_arrived(run, request):
    run_dir = request.getfixturevalue(run)
    marks = [load_json(run_dir, f"barrier-{me}") for me in range(N)]
    for dc in "ab":
        mine = [m for m in marks if m["dc"] == dc]
        assert len(mine) == PER_DC
        assert min(m["dc_exit"] for m in mine) >= max(m["dc_enter"] for m in mine), f"DC {dc} barrier"
    assert min(m["g_exit"] for m in marks) >= max(m["g_enter"] for m in marks), "global barrier"
