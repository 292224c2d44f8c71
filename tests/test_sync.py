"""Synchronization algorithms: HFA and DiLoCo (model averaging on the workers, DC-only rounds at the local
servers), DGA, --slowdown, and DCASGD on the global server in dist_async.

The workers inject deterministic gradients (tests/scripts/kvhelp.py) into a plain SGD, so every worker's model
after every step can be recomputed here and compared number for number. Cases with a slowdown (set per process),
ESync and DCASGD run as real deployments (processes over sockets, started by the launcher); the others run the
same worker code as threads of a whole in-process deployment (tests/scripts/inproc.py: the real schedulers,
servers and KVStores over the in-memory van), which saves the suite five torch start-ups per case.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import kvhelp
from averaging import KEYS, LR, SEED, train
from inproc import DEADLINE_S, HipsCluster
from harness import check_ok, launch, load_json, load_npz

AVERAGING_SCRIPT = """
import json, os
import torch
import geomx, kvhelp as h
from averaging import train

torch.set_num_threads(1)
kv = geomx.kvstore.create(reduction="mean")
me = h.worker_index()
samples = json.loads(os.environ["TEST_SAMPLES"])[me] if me >= 0 else None
models, info = train(kv, me, int(os.environ["TEST_STEPS"]), samples=samples, compute_s=0.02)
if not kv.is_master_worker:
    h.save(f"models-{me}", models)
    h.dump(f"sync-{me}", info)
"""


def simulate(*, algorithm: str, k1: int, k2: int, weights: str, samples: list[float], dcs: list[list[int]],
             steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9, overlap: int = 0,
             dc_sync: str = "models", keep: float = 1.0, dc_overlap: int = 0) -> dict:
    """Float64 reference: {(worker, key, step): model}; local SGD, DC and global (weighted) averages, and for
    DiLoCo torch's Nesterov SGD on the pseudo-gradient. ``overlap`` D: a global average is computed from the
    models at its boundary and adopted D DC periods later, each worker keeping its progress since then;
    ``dc_sync="gradients"``: a DC's workers step on their DC's weighted mean gradient every step (with SGD from
    equal models: the DC's mean model after every step); ``keep``: the share of the progress since the send kept
    on top of an overlapped average; ``dc_overlap`` S: a DC-only average is computed from the models at its
    boundary and adopted S steps later (at a boundary: before anything else there), each worker keeping all of
    its progress since; (worker, key, "final"): after finish() landed the last one (of several in flight, the
    last sent)."""
    n = sum(len(d) for d in dcs)
    out = {}
    for key, shape in KEYS.items():
        init = kvhelp.value(0, key, shape).astype(np.float64)
        w = {i: init.copy() for i in range(n)}
        anchor, buf = init.copy(), None
        flights = []            # (period sent, models sent, new global model), oldest first
        dc_flight = None        # (step sent, models sent, their DC's mean by worker) of the DC average travelling

        def dc_mean(d, w):
            return sum(samples[i] * w[i] for i in d) / sum(samples[i] for i in d)

        def land(w, flight):
            _, sent, new = flight
            for i in range(n):
                w[i] = new + keep * (w[i] - sent[i])

        for step in range(steps):
            for i in range(n):
                w[i] = w[i] - LR * kvhelp.grad(SEED, i, step, key, shape).astype(np.float64)
            if dc_sync == "gradients":
                means = [dc_mean(d, w) for d in dcs]
                for d, m in zip(dcs, means, strict=False):
                    for i in d:
                        w[i] = m.copy()
            t = step + 1
            if dc_flight is not None and t - dc_flight[0] == dc_overlap:
                _, sent, means = dc_flight
                for i in range(n):
                    w[i] = w[i] + means[i] - sent[i]
                dc_flight = None
            if t % k1 == 0:
                period = t // k1
                while flights and period - flights[0][0] == overlap:
                    land(w, flights.pop(0))
                if period % k2:
                    means = [dc_mean(d, w) for d in dcs]
                    if dc_overlap:
                        dc_flight = (t, {i: w[i].copy() for i in range(n)},
                                     {i: m for d, m in zip(dcs, means, strict=False) for i in d})
                    else:
                        for d, m in zip(dcs, means, strict=False):
                            for i in d:
                                w[i] = m.copy()
                else:
                    if weights == "samples":
                        avg = sum(samples[i] * w[i] for i in range(n)) / sum(samples)
                    else:
                        avg = sum(dc_mean(d, w) for d in dcs) / len(dcs)
                    if algorithm == "diloco":
                        delta = anchor - avg
                        buf = delta.copy() if buf is None else outer_momentum * buf + delta
                        anchor = anchor - outer_lr * (delta + outer_momentum * buf)
                        avg = anchor.copy()
                    if overlap:
                        flights.append((period, {i: w[i].copy() for i in range(n)}, avg))
                    else:
                        for i in range(n):
                            w[i] = avg.copy()
            for i in range(n):
                out[(i, key, step)] = w[i]
        if dc_flight is not None:
            _, sent, means = dc_flight
            for i in range(n):
                w[i] = w[i] + means[i] - sent[i]
        if flights:     # finish(): the earlier ones only moved the global model (computed at the send here)
            land(w, flights[-1])
        for i in range(n):
            out[(i, key, "final")] = w[i]
    return out


CASES = {
    # K1 = 2, K2 = 2, unequal samples: DC averages at steps 2 and 6, a global one at step 4; worker b1 3x slower
    "hfa-weighted": dict(algorithm="hfa", k1=2, k2=2, weights="samples", per_dc=[2, 2], samples=[10, 20, 30, 40],
                         steps=6, slowdown=["b:1=3"]),
    # DiLoCo with equal DC weights, a DC of 2 and a DC of 1: global (outer) steps at 2 and 4 and 6
    "diloco-equal": dict(algorithm="diloco", k1=1, k2=2, weights="equal", per_dc=[2, 1], samples=[5, 7, 9],
                         steps=6, slowdown=None),
    # overlapped global averages (sent at steps 3 and 6, adopted 2 DC periods later, at 5 and 8), with DC
    # averages in between; DiLoCo with D = K2: each outer step lands as the next one leaves (steps 4, 6), the
    # last one at finish()
    "hfa-overlap": dict(algorithm="hfa", k1=1, k2=3, overlap=2, weights="samples", per_dc=[2, 2],
                        samples=[10, 20, 30, 40], steps=8, slowdown=None),
    "diloco-overlap": dict(algorithm="diloco", k1=1, k2=2, overlap=2, weights="equal", per_dc=[2, 1],
                           samples=[5, 7, 9], steps=7, slowdown=None),
    # D > K2: two global averages in flight at once (sent at steps 2, 4, 6, 8, each adopted 3 DC periods later,
    # at 5, 7, 9, the last at finish()); HFA keeping half, and DiLoCo, whose outer steps land in send order
    "hfa-overlap-two": dict(algorithm="hfa", k1=1, k2=2, overlap=3, keep=0.5, weights="samples", per_dc=[2, 2],
                            samples=[10, 20, 30, 40], steps=9, slowdown=None),
    "diloco-overlap-two": dict(algorithm="diloco", k1=1, k2=2, overlap=3, weights="equal", per_dc=[2, 1],
                               samples=[5, 7, 9], steps=9, slowdown=None),
    # hfa-overlap keeping half of the steps taken while each average travelled
    "hfa-overlap-keep": dict(algorithm="hfa", k1=1, k2=3, overlap=2, keep=0.5, weights="samples", per_dc=[2, 2],
                             samples=[10, 20, 30, 40], steps=8, slowdown=None),
    # DC averages overlapped too (sent at steps 1, 2, 4, 5, 7, each adopted at the next step), with the global
    # averages of hfa-overlap-keep; and DiLoCo with a DC of one worker, which has no DC round to overlap
    "hfa-dc-overlap": dict(algorithm="hfa", k1=1, k2=3, overlap=2, keep=0.5, dc_overlap=1, weights="samples",
                           per_dc=[2, 2], samples=[10, 20, 30, 40], steps=8, slowdown=None),
    "diloco-dc-overlap": dict(algorithm="diloco", k1=1, k2=3, dc_overlap=1, weights="equal", per_dc=[2, 1],
                              samples=[5, 7, 9], steps=7, slowdown=None),
    # K1 = 3: DC averages sent at steps 3 and 9 and adopted one step later (4 and 10), or at the next boundary
    # (dc_overlap = K1: 6 and 12), with an overlapped global average sent at step 6 and adopted at 9
    "hfa-dc-overlap-step": dict(algorithm="hfa", k1=3, k2=2, overlap=1, dc_overlap=1, weights="samples",
                                per_dc=[2, 2], samples=[10, 20, 30, 40], steps=11, slowdown=None),
    "hfa-dc-overlap-period": dict(algorithm="hfa", k1=3, k2=2, overlap=1, dc_overlap=3, weights="samples",
                                  per_dc=[2, 2], samples=[10, 20, 30, 40], steps=11, slowdown=None),
    # the DC's workers step on their mean gradient every step, global averages overlapped as in hfa-overlap
    "hfa-dc-gradients": dict(algorithm="hfa", k1=1, k2=3, overlap=2, dc_sync="gradients", weights="samples",
                             per_dc=[2, 2], samples=[10, 20, 30, 40], steps=8, slowdown=None),
}


def _sync_table(case: dict) -> dict:
    return {"algorithm": case["algorithm"], "k1": case["k1"], "k2": case["k2"], "weights": case["weights"],
            **({"overlap": case["overlap"]} if case.get("overlap") else {}),
            **({"dc_sync": case["dc_sync"]} if case.get("dc_sync") else {}),
            **({"overlap_keep": case["keep"]} if "keep" in case else {}),
            **({"dc_overlap": case["dc_overlap"]} if case.get("dc_overlap") else {})}


def _run_case(tmp_path, case: dict, name: str) -> tuple[list[dict], list[dict]]:
    """A real deployment running AVERAGING_SCRIPT: (each worker's models by "key@step", each worker's sync info)."""
    env = {"TEST_STEPS": str(case["steps"]), "TEST_SAMPLES": str(case["samples"])}
    run_dir = check_ok(launch(tmp_path, AVERAGING_SCRIPT, dcs=2, workers_per_dc=case["per_dc"], env=env, name=name,
                              sync=_sync_table(case), slowdown=case["slowdown"]))
    n = sum(case["per_dc"])
    return [load_npz(run_dir, f"models-{i}") for i in range(n)], [load_json(run_dir, f"sync-{i}") for i in range(n)]


def _averaging_worker(kv, me: int, steps: int, samples, policy, compression: dict | None) -> tuple[dict, dict]:
    """AVERAGING_SCRIPT's worker, on a KVStore of an in-process deployment (``me`` = -1: the master worker)."""
    if compression:
        kv.set_gradient_compression(compression)
    return train(kv, me, steps, samples=samples, sync=policy)


def _run_inproc(sync_table: dict, per_dc: list[int], steps: int, samples: list,
                compression: dict | None = None) -> tuple[list[dict], list[dict]]:
    """The same workers as threads of one in-process deployment; the policy is built from the environment the
    launcher would give every worker for ``sync_table`` (geomx.sync.launch_env), as ``geomx launch`` does."""
    from geomx.sync import launch_env, policy_class, settings_from_env

    settings = settings_from_env(launch_env(sync_table))
    cluster = HipsCluster(per_dc=list(per_dc))
    try:
        stores = [kv for dc in ("a", "b") for kv in cluster.workers[dc]]
        with ThreadPoolExecutor(len(stores) + 1) as pool:
            futures = [pool.submit(_averaging_worker, kv, me, steps, samples[me] if me >= 0 else None,
                                   policy_class(settings.algorithm)(**settings.options()), compression)
                       for me, kv in [(-1, cluster.master), *enumerate(stores)]]
            results = [f.result(timeout=DEADLINE_S) for f in futures][1:]
    finally:
        cluster.close()
    return [models for models, _ in results], [info for _, info in results]


def _run_averaging(tmp_path, case: dict, name: str) -> tuple[list[dict], list[dict]]:
    if case["slowdown"]:          # a slowdown is per process (GEOMX_SLOWDOWN): a real deployment
        return _run_case(tmp_path, case, name)
    return _run_inproc(_sync_table(case), case["per_dc"], case["steps"], case["samples"])


def _reference_args(case: dict, dcs: list[list[int]]) -> dict:
    return dict(algorithm=case["algorithm"], k1=case["k1"], k2=case["k2"], weights=case["weights"],
                samples=[float(s) for s in case["samples"]], dcs=dcs, steps=case["steps"],
                overlap=case.get("overlap", 0), dc_sync=case.get("dc_sync", "models"), keep=case.get("keep", 1.0),
                dc_overlap=case.get("dc_overlap", 0))


@pytest.mark.parametrize("name", list(CASES))
def test_model_averaging_matches_the_reference_at_every_step(tmp_path, name):
    case = CASES[name]
    models, infos = _run_averaging(tmp_path, case, name)
    per_dc = case["per_dc"]
    dcs = [list(range(sum(per_dc[:d]), sum(per_dc[:d + 1]))) for d in range(len(per_dc))]
    ref = simulate(**_reference_args(case, dcs))
    n = sum(per_dc)
    for (i, key, step), expected in ref.items():
        np.testing.assert_allclose(models[i][f"{key}@{step}"], expected, rtol=0, atol=2e-5,
                                   err_msg=f"{name}: worker {i}, key {key}, step {step}")
    last = case["steps"] - 1
    assert all(x["global_averages"] == case["steps"] // (case["k1"] * case["k2"]) for x in infos), infos
    # overlapped averages that reached their landing step during the run (finish() lands the rest uncounted)
    landed = max(0, (case["steps"] // case["k1"] - case["overlap"]) // case["k2"]) if case.get("overlap") else None
    assert all((x["landings"] or {}).get("landings") == landed for x in infos), infos
    assert all(x["landings"] is None or 0 <= x["landings"]["late"] <= landed for x in infos), infos
    # every second the policy made training wait is charged to one phase of its work, and only to phases it has
    for x in infos:
        phases = x["wait_phases"]
        assert abs(sum(phases.values()) - x["comm_wait_s"]) < 1e-6, x
        overlapped_dc, waited_dc = phases["dc_send"] + phases["dc_landing"], phases["dc_average"]
        assert overlapped_dc > 0 if case.get("dc_overlap") and x["dc_workers"] > 1 else overlapped_dc == 0, x
        assert waited_dc == 0 if case.get("dc_overlap") or x["dc_workers"] == 1 else waited_dc > 0, x
        overlapped_global = phases["global_send"] + phases["global_landing"]
        assert (overlapped_global > 0 and phases["global_average"] == 0 if case.get("overlap")
                else overlapped_global == 0 and phases["global_average"] > 0), x
    if name == "hfa-overlap":
        # while the average sent at step 3 travels (steps 3 and 4: indices 2, 3) the DCs train on their own
        # models, not on the average as a blocking HFA does
        blocking = simulate(algorithm="hfa", k1=1, k2=3, weights="samples", samples=[10.0, 20.0, 30.0, 40.0],
                            dcs=dcs, steps=8)
        assert np.abs(models[0]["w@3"] - models[2]["w@3"]).max() > 1e-3
        assert np.abs(blocking[(0, "w", 3)] - ref[(0, "w", 3)]).max() > 1e-3
        assert "overlap=2" in infos[0]["algorithm"]
    elif name == "hfa-overlap-keep":
        # the landing at step 5 (index 4) differs from keeping all of the progress, before it they agree
        full = simulate(algorithm="hfa", k1=1, k2=3, weights="samples", samples=[10.0, 20.0, 30.0, 40.0],
                        dcs=dcs, steps=8, overlap=2)
        assert np.abs(full[(0, "w", 4)] - ref[(0, "w", 4)]).max() > 1e-3
        np.testing.assert_allclose(full[(0, "w", 3)], ref[(0, "w", 3)], rtol=0, atol=1e-12)
        assert "overlap_keep=0.5" in infos[0]["algorithm"]
    elif name == "hfa-dc-gradients":
        # at a global boundary (step 3: index 2) a DC's workers are still one model, where averaging models
        # leaves them apart until the next DC average
        models_ref = simulate(algorithm="hfa", k1=1, k2=3, weights="samples", samples=[10.0, 20.0, 30.0, 40.0],
                              dcs=dcs, steps=8, overlap=2)
        np.testing.assert_array_equal(models[0]["w@2"], models[1]["w@2"])
        assert np.abs(models_ref[(0, "w", 2)] - models_ref[(1, "w", 2)]).max() > 1e-3
        assert "dc_sync='gradients'" in infos[0]["algorithm"]
    elif name == "diloco-overlap":
        assert "overlap=2" in infos[0]["algorithm"]
    elif name in ("hfa-dc-overlap", "diloco-dc-overlap"):
        # the DC average sent at step 1 (index 0) is not in yet: a DC's workers still differ there, where a
        # waited-for DC average makes them one model; from step 2 on the overlapped schedule is its own
        waited = simulate(**{**_reference_args(case, dcs), "dc_overlap": 0})
        assert np.abs(models[0]["w@0"] - models[1]["w@0"]).max() > 1e-3
        np.testing.assert_allclose(waited[(0, "w", 0)], waited[(1, "w", 0)], rtol=0, atol=1e-12)
        assert np.abs(waited[(0, "w", last)] - ref[(0, "w", last)]).max() > 1e-3
        assert "dc_overlap=1" in infos[0]["algorithm"]
    elif name in ("hfa-dc-overlap-step", "hfa-dc-overlap-period"):
        # the DC average sent at step 3 is not in at step 3 (index 2), where waiting for it makes the DC's
        # workers one model; one step late it is in at step 4 (index 3), a whole period late it is not
        waited = simulate(**{**_reference_args(case, dcs), "dc_overlap": 0})
        other = simulate(**{**_reference_args(case, dcs), "dc_overlap": 4 - case["dc_overlap"]})
        assert np.abs(models[0]["w@2"] - models[1]["w@2"]).max() > 1e-3
        np.testing.assert_allclose(waited[(0, "w", 2)], waited[(1, "w", 2)], rtol=0, atol=1e-12)
        assert np.abs(other[(0, "w", 3)] - ref[(0, "w", 3)]).max() > 1e-3
        assert f"dc_overlap={case['dc_overlap']}" in infos[0]["algorithm"]
    elif name in ("hfa-overlap-two", "diloco-overlap-two"):
        # two averages in flight: not the schedule that lands each one as the next leaves (D = K2)
        assert "overlap=3" in infos[0]["algorithm"]
        one_at_a_time = simulate(**{**_reference_args(case, dcs), "overlap": 2})
        assert np.abs(one_at_a_time[(0, "w", last)] - ref[(0, "w", last)]).max() > 1e-3
    elif name == "hfa-weighted":
        # after a DC average the DC's workers agree and the DCs differ; after the global one everyone agrees
        a0, a1, b0 = (models[i]["w@1"] for i in (0, 1, 2))
        np.testing.assert_array_equal(a0, a1)
        assert np.abs(a0 - b0).max() > 1e-3
        assert all(np.array_equal(models[i]["w@3"], models[0]["w@3"]) for i in range(n))
        assert np.abs(models[0]["w@5"] - models[2]["w@5"]).max() > 1e-3
        # only worker b1 was slowed: it slept (3 - 1) x its ~20 ms of compute per step
        assert [x["factor"] for x in infos] == [1.0, 1.0, 1.0, 3.0]
        assert infos[3]["slept_s"] >= 2 * 0.02 * case["steps"] and all(x["slept_s"] == 0 for x in infos[:3])
    else:
        assert ("DiLoCo(k1=1, k2=2, weights='equal', overlap=0, overlap_keep=1.0, dc_sync='models', dc_overlap=0, "
                "outer_lr=0.7"
                in infos[0]["algorithm"])
        # the outer step is not a plain average: HFA's reference differs
        hfa = simulate(algorithm="hfa", k1=1, k2=2, weights="equal", samples=[5.0, 7.0, 9.0], dcs=dcs, steps=6)
        assert np.abs(hfa[(0, "w", last)] - ref[(0, "w", last)]).max() > 1e-3


@pytest.mark.parametrize("table", [dict(algorithm="hfa", overlap=2, overlap_keep=0.5),
                                   dict(algorithm="diloco", overlap=2)])
def test_finish_with_several_averages_in_flight_leaves_every_worker_on_the_same_model(table):
    """D = 2 > K2 = 1: two averages still travel after the last step. Landing each in turn had kept each one's
    w - w_sent of the worker's own, so after finish() the two DCs' workers held different models."""
    steps, samples = 6, [10, 30]
    models, _ = _run_inproc({**table, "k1": 1, "k2": 1, "weights": "samples"}, [1, 1], steps, samples)
    ref = simulate(algorithm=table["algorithm"], k1=1, k2=1, weights="samples", samples=[10.0, 30.0],
                   dcs=[[0], [1]], steps=steps, overlap=2, keep=table.get("overlap_keep", 1.0))
    for key in KEYS:
        assert np.abs(models[0][f"{key}@{steps - 1}"] - models[1][f"{key}@{steps - 1}"]).max() > 1e-3
        np.testing.assert_allclose(models[0][f"{key}@final"], models[1][f"{key}@final"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(models[0][f"{key}@final"], ref[(0, key, "final")], rtol=0, atol=2e-5)


def test_overlapped_dc_averages_of_tensors_that_travel_alone_match_the_reference(monkeypatch):
    """GEOMX_FUSION_BYTES=0: every tensor its own key, each packed in its own shape (the shape its key was
    initialized with); the one-step-late DC averages still give the reference's model at every step."""
    monkeypatch.setenv("GEOMX_FUSION_BYTES", "0")
    case = CASES["hfa-dc-overlap-step"]
    models, _ = _run_inproc(_sync_table(case), case["per_dc"], case["steps"], case["samples"])
    ref = simulate(**_reference_args(case, [[0, 1], [2, 3]]))
    for (i, key, step), expected in ref.items():
        np.testing.assert_allclose(models[i][f"{key}@{step}"], expected, rtol=0, atol=2e-5,
                                   err_msg=f"worker {i}, key {key}, step {step}")


def test_hfa_composes_with_compression_its_global_averages_travel_as_compressed_model_changes(tmp_path):
    """fp16 on both tiers: the global average moves each worker's change since the last global average in 16
    bits (a model itself would lose its low bits for good), so the run tracks the exact reference within
    fp16's rounding of those changes, and not exactly (the compression did act)."""
    case = CASES["hfa-weighted"]
    # in process: the slowdown only stretches time, the values are the same
    models, _ = _run_inproc(_sync_table(case), case["per_dc"], case["steps"], case["samples"],
                            compression={"type": "fp16"})
    dcs = [[0, 1], [2, 3]]
    ref = simulate(algorithm="hfa", k1=case["k1"], k2=case["k2"], weights=case["weights"],
                   samples=[float(s) for s in case["samples"]], dcs=dcs, steps=case["steps"])
    worst = max(np.abs(models[i][f"{key}@{step}"] - expected).max() for (i, key, step), expected in ref.items())
    assert 1e-6 < worst < 2e-3, worst
    assert all(np.array_equal(models[i]["w@3"], models[0]["w@3"]) for i in range(4))   # the global average agrees


def test_two_overlapped_averages_in_flight_under_compression_each_land_on_their_own_base():
    """D > K2 with fp16: the second average leaves (as changes since the global model of then) before the first
    lands and replaces that model; landing it adds its mean change to the base it left from, so the run still
    tracks the exact reference within fp16's rounding, and not exactly (the compression did act)."""
    case = CASES["hfa-overlap-two"]
    models, _ = _run_inproc(_sync_table(case), case["per_dc"], case["steps"], case["samples"],
                            compression={"type": "fp16"})
    ref = simulate(**_reference_args(case, [[0, 1], [2, 3]]))
    worst = max(np.abs(models[i][f"{key}@{step}"] - expected).max() for (i, key, step), expected in ref.items())
    assert 1e-6 < worst < 2e-3, worst


@pytest.fixture
def pushed_keys(monkeypatch) -> list:
    """Every key (a tuple for a list of keys) a KVStore.pushpull of this test names, in order."""
    from geomx.kvstore.kvstore import KVStore

    sent, pushpull = [], KVStore.pushpull

    def recording(self, key, *args, **kwargs):
        sent.append(key if isinstance(key, str) else tuple(key))
        return pushpull(self, key, *args, **kwargs)

    monkeypatch.setattr(KVStore, "pushpull", recording)
    return sent


def test_fused_averages_send_one_key_per_bucket_and_give_the_models_of_one_key_per_tensor_bit_for_bit(
        monkeypatch, pushed_keys):
    """Tensor fusion (geomx.sync.fusion) packs w and b into one bucket: the servers sum the same numbers in the same
    order, so every model at every step is identical to the run with a key per tensor (GEOMX_FUSION_BYTES=0)."""
    case = CASES["hfa-weighted"]
    run = lambda: _run_inproc(_sync_table(case), case["per_dc"], case["steps"], case["samples"])  # noqa: E731
    fused, _ = run()
    fused_keys = list(pushed_keys)
    pushed_keys.clear()
    monkeypatch.setenv("GEOMX_FUSION_BYTES", "0")
    alone, _ = run()
    averages = 4 * case["steps"] // case["k1"]          # every worker averages at every K1 boundary
    assert fused_keys.count("__geomx.fused/average/w+2") == averages
    assert not any(k in ("w", "b", ("w", "b")) for k in fused_keys), fused_keys
    assert pushed_keys.count("w") == averages == pushed_keys.count("b")
    assert not any("fused" in str(k) for k in pushed_keys)
    for i in range(4):
        for name, model in fused[i].items():
            np.testing.assert_array_equal(model, alone[i][name], err_msg=f"worker {i}, {name}")


def test_under_an_elementwise_codec_global_averages_travel_fused_and_give_the_models_of_one_key_per_tensor(
        monkeypatch, pushed_keys):
    """bf16 on the WAN reads each value on its own (Codec.elementwise): the global averages' model changes travel
    fused like the DC averages, and every model at every step is the one a key per tensor gives, bit for bit."""
    case = CASES["hfa-weighted"]           # K1 = 2, K2 = 2, 6 steps: DC averages at steps 2 and 6, global at 4
    run = lambda: _run_inproc(_sync_table(case), case["per_dc"], case["steps"], case["samples"],  # noqa: E731
                              compression={"wan": "bf16"})
    fused, _ = run()
    assert pushed_keys.count("__geomx.fused/average/w+2") == 4 * 3
    assert not any(k in ("w", "b") for k in pushed_keys), pushed_keys
    pushed_keys.clear()
    monkeypatch.setenv("GEOMX_FUSION_BYTES", "0")
    alone, _ = run()
    assert pushed_keys.count("w") == 4 * 3 == pushed_keys.count("b")
    for i in range(4):
        for name, model in fused[i].items():
            np.testing.assert_array_equal(model, alone[i][name], err_msg=f"worker {i}, {name}")


def test_under_a_codec_that_reads_a_tensor_whole_global_averages_travel_a_key_per_tensor(pushed_keys):
    """top-k on the WAN picks entries tensor by tensor: the DC-only rounds (LAN, dense) are fused, the global
    averages go through the codec a tensor at a time (as model changes)."""
    case = CASES["hfa-weighted"]
    _run_inproc(_sync_table(case), case["per_dc"], case["steps"], case["samples"],
                compression={"wan": {"type": "topk", "ratio": 0.5}, "size_lower_bound": 0})
    assert pushed_keys.count("__geomx.fused/average/w+2") == 4 * 2
    assert pushed_keys.count("w") == 4 * 1 == pushed_keys.count("b")


def test_fsa_pushes_its_dense_gradients_fused_and_steps_exactly_as_with_a_key_per_parameter(pushed_keys):
    """FSA's buckets (geomx.sync.fusion.GradientBuckets): one push per bucket per step, and the mean gradient the
    servers return is ((g0 + g1) + (g2 + g3)) / 4 for every element, as with a key per parameter."""
    steps = 3
    models, infos = _run_inproc({"algorithm": "fsa"}, [2, 2], steps, [1, 1, 1, 1])
    assert infos[0]["algorithm"] == "FSA(backward_passes_per_step=1)"
    assert pushed_keys.count("__geomx.fused/gradients/w+2") == 4 * steps
    assert not any(k in ("w", "b") for k in pushed_keys), pushed_keys
    for key, shape in KEYS.items():
        for step, expected in enumerate(_fsa_reference(key, shape, steps)):
            for i in range(4):
                np.testing.assert_array_equal(models[i][f"{key}@{step}"], expected, err_msg=f"{key} step {step}")


def _fsa_reference(key, shape, steps: int) -> list[np.ndarray]:
    """FSA with SGD as the servers and torch compute it in float32: w -= lr * ((g0 + g1) + (g2 + g3)) / 4."""
    w, out = torch.from_numpy(kvhelp.value(0, key, shape)), []
    for step in range(steps):
        g = [kvhelp.grad(SEED, i, step, key, shape) for i in range(4)]
        w = w.clone().add_(torch.from_numpy(((g[0] + g[1]) + (g[2] + g[3])) / np.float32(4)), alpha=-LR)
        out.append(w.numpy())
    return out


def test_dga_with_delay_zero_is_fsa_exactly(tmp_path, pushed_keys):
    models, infos = _run_inproc({"algorithm": "dga", "delay": 0}, [2, 2], 3, [1, 1, 1, 1])
    assert infos[0]["algorithm"] == "DGA(delay=0)"
    # its gradients travel fused: one bucket a step and worker
    assert pushed_keys.count("__geomx.fused/dga/w+2") == 4 * 3 and "w" not in pushed_keys
    for key, shape in KEYS.items():
        for step, expected in enumerate(_fsa_reference(key, shape, 3)):
            for i in range(4):
                np.testing.assert_array_equal(models[i][f"{key}@{step}"], expected, err_msg=f"{key} step {step}")


def test_dga_applies_the_average_from_d_steps_ago_with_the_correction(tmp_path):
    delay, steps = 2, 6
    models, _ = _run_inproc({"algorithm": "dga", "delay": delay}, [1, 2], steps, [1, 1, 1])
    for key, shape in KEYS.items():
        g = {(i, t): kvhelp.grad(SEED, i, t, key, shape).astype(np.float64) for i in range(3) for t in range(steps)}
        w = {i: kvhelp.value(0, key, shape).astype(np.float64) for i in range(3)}
        for t in range(steps):
            for i in range(3):
                used = g[i, t] if t < delay else g[i, t] - g[i, t - delay] + sum(g[j, t - delay] for j in range(3)) / 3
                w[i] = w[i] - LR * used
                np.testing.assert_allclose(models[i][f"{key}@{t}"], w[i], rtol=0, atol=2e-5,
                                           err_msg=f"worker {i}, key {key}, step {t}")
        # the workers' models differ by their own last D gradients: DGA is not FSA with a delay
        assert np.abs(models[0][f"{key}@{steps - 1}"] - models[1][f"{key}@{steps - 1}"]).max() > 1e-3


def test_hfa_with_k1_k2_one_is_fsa_model_averaging_exactly(tmp_path):
    """Every step a global average: exactly ((a0 + a1) + (b0 + b1)) / 4 of the locally stepped models, in float32
    as the servers sum; and (plain SGD) what FSA's gradient averaging gives, up to rounding."""
    case = dict(algorithm="hfa", k1=1, k2=1, weights="samples", per_dc=[2, 2], samples=[100, 100, 100, 100],
                steps=3, slowdown=None)
    models, _ = _run_averaging(tmp_path, case, "hfa-1-1")
    for key, shape in KEYS.items():
        w = torch.from_numpy(kvhelp.value(0, key, shape))
        fsa = kvhelp.value(0, key, shape).astype(np.float64)
        for step in range(case["steps"]):
            local = []
            for i in range(4):
                p = w.clone()
                p.add_(torch.from_numpy(kvhelp.grad(SEED, i, step, key, shape)), alpha=-LR)   # torch SGD's update
                local.append(p.numpy())
            w = torch.from_numpy(((local[0] + local[1]) + (local[2] + local[3])) / np.float32(4))
            fsa = fsa - LR * np.mean([kvhelp.grad(SEED, i, step, key, shape) for i in range(4)], axis=0)
            for i in range(4):
                np.testing.assert_array_equal(models[i][f"{key}@{step}"], w.numpy(), err_msg=f"{key} step {step}")
            np.testing.assert_allclose(w.numpy(), fsa, rtol=0, atol=1e-6)


ORDER = "abbaab"      # b's second push follows its own: the server's previous weight is a's, not b's backup
DCASGD_SCRIPT = f"""
import numpy as np
import geomx, kvhelp as h

SEED, ORDER = {SEED}, {ORDER!r}
kv = geomx.kvstore.create("dist_async", reduction="mean")
if kv.is_master_worker:
    kv.set_optimizer("DCASGD", lr=0.1, lamda=2.0)
kv.init("w", h.value(0, "w", (10,)))
if kv.is_master_worker:
    raise SystemExit(0)
me = 0 if kv.dc == "a" else 1
reads = []
for turn, who in enumerate(ORDER):
    # strict turns in ORDER, so the server applies the DCs' gradients in a known order
    if who != "ab"[me]:
        continue
    if turn > 0:
        h.wait_for_file(h.run_dir() / f"turn-{{turn - 1}}.json")
    reads.append(kv.pushpull("w", h.grad(SEED, me, len(reads), "w", (10,))).wait())
    h.dump(f"turn-{{turn}}", turn)
h.save(f"reads-{{me}}", {{"reads": np.stack(reads)}})
"""


def test_dcasgd_on_the_global_server_compensates_each_dc_against_its_own_backup(tmp_path):
    run_dir = check_ok(launch(tmp_path, DCASGD_SCRIPT, dcs=2, workers_per_dc=1, mode="dist_async"))
    reads = {me: load_npz(run_dir, f"reads-{me}")["reads"] for me in (0, 1)}

    def replay(per_dc: bool) -> dict:
        w = kvhelp.value(0, "w", (10,)).astype(np.float64)
        backup, previous, out = {0: w.copy(), 1: w.copy()}, w.copy(), {0: [], 1: []}
        for who in ORDER:
            me = "ab".index(who)
            g = kvhelp.grad(SEED, me, len(out[me]), "w", (10,)).astype(np.float64) / 2   # the server's divisor
            bak = backup[me] if per_dc else previous
            previous = w.copy()
            w = w - 0.1 * (g + 2.0 * g * g * (w - bak))
            backup[me] = w.copy()
            out[me].append(w.copy())
        return out

    paper, mxnet = replay(True), replay(False)
    for me in (0, 1):
        np.testing.assert_allclose(reads[me], np.stack(paper[me]), rtol=0, atol=1e-5)
    # the test tells the two rules apart
    assert max(np.abs(np.stack(paper[me]) - np.stack(mxnet[me])).max() for me in (0, 1)) > 1e-3


ESYNC_SCRIPT = f"""
import time
import torch
import geomx, kvhelp as h
from geomx.torch import DistributedOptimizer

torch.set_num_threads(1)
SEED, KEYS, LR, ROUNDS = {SEED}, {KEYS!r}, {LR}, 6
kv = geomx.kvstore.create(reduction="mean")
me = h.worker_index()
params = {{k: torch.nn.Parameter(torch.from_numpy(h.value(0 if me < 0 else me + 1, k, s))) for k, s in KEYS.items()}}
opt = DistributedOptimizer(torch.optim.SGD(params.values(), lr=LR), list(params.items()), kvstore=kv)
if kv.is_master_worker:
    raise SystemExit(0)
out, local = {{}}, 0
while opt.progress < ROUNDS:
    opt.zero_grad()
    time.sleep(0.1)                                    # "compute"; DC b's worker is slowed 3x
    for k, p in params.items():
        p.grad = torch.from_numpy(h.grad(SEED, me, local, k, KEYS[k]))
    local += 1
    before = opt.progress
    opt.step()
    if opt.progress != before:
        for k, p in params.items():
            out[f"{{k}}@{{opt.progress - 1}}"] = p.detach().numpy().copy()
opt.finish()                                           # overlap: the last global average lands
for k, p in params.items():
    out[f"{{k}}@final"] = p.detach().numpy().copy()
h.save(f"models-{{me}}", out)
h.dump(f"esync-{{me}}", {{"schedule": opt.sync.schedule, "local": local}})
"""


def test_esync_gives_the_slowed_worker_fewer_local_steps_and_averages_model_deltas(tmp_path):
    run_dir = check_ok(launch(tmp_path, ESYNC_SCRIPT, dcs=2, workers_per_dc=1, sync="esync", slowdown=["b=3"]))
    fast, slow = (load_json(run_dir, f"esync-{i}")["schedule"] for i in (0, 1))
    assert slow == [1] * 6, slow                        # the slowest worker takes `steps` (1) per round
    # ~3x faster: ~3 local steps per round. Each round's count comes from one round's timing, which a loaded
    # machine can stretch for either worker (a 45 ms stall of b's step makes a 5), so the median of the five
    # rounds is held to [2, 4], two odd rounds allowed; the models below are checked for whatever schedule ran
    assert fast[0] == 1 and 2 <= sorted(fast[1:])[2] <= 4 and min(fast) >= 1, fast
    models = [load_npz(run_dir, f"models-{i}") for i in (0, 1)]
    for key, shape in KEYS.items():
        start = kvhelp.value(0, key, shape).astype(np.float64)
        taken = [0, 0]
        for r in range(6):
            deltas = []
            for i, schedule in enumerate((fast, slow)):
                w = start.copy()
                for _ in range(schedule[r]):
                    w -= LR * kvhelp.grad(SEED, i, taken[i], key, shape)
                    taken[i] += 1
                deltas.append(w - start)
            start = start + (deltas[0] + deltas[1]) / 2
            for i in (0, 1):
                np.testing.assert_allclose(models[i][f"{key}@{r}"], start, rtol=0, atol=2e-5,
                                           err_msg=f"worker {i}, key {key}, round {r}")
