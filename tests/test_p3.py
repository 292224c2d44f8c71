"""P3 (``--sync p3``, GeoMX's ``ENABLE_P3=1``): step() returns with the replies still on their way, each layer's
weights land in the forward pass, and the model after k steps is FSA's bit for bit; misuse is refused naming the
fix. In-process deployments (tests/scripts/inproc.py): 2 DCs x 1 worker, the servers' Adam."""
import threading

import pytest
import torch

from geomx.compression import CODECS
from geomx.errors import ConfigError
from geomx.sync.p3 import P3
from geomx.sync.settings import settings_from_env
from inproc import DEADLINE_S, HipsCluster

STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)


def _in_threads(fns) -> None:
    errors: list = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    if errors:
        raise errors[0]


def _train(sync, observe=None, set_to_none: bool = True, compression: dict | None = None,
           layouts: dict | None = None, mode: str = "dist_sync", dcs: tuple[str, ...] = ("a", "b")) -> list[dict]:
    """Every worker's weights (one per DC of ``dcs``) after STEPS steps with ``sync``, a name or a policy
    factory (the master worker sets the servers' Adam); ``layouts``: filled with the first worker's parts per
    parameter."""
    from geomx.torch import DistributedOptimizer

    cluster = HipsCluster(dcs=dcs, per_dc=1, mode=mode)
    try:
        kvs = [cluster.master, *(kv for dc in dcs for kv in cluster.workers[dc])]
        if compression is not None:
            for kv in kvs:
                kv.set_gradient_compression(compression)
        models = [_model() for _ in kvs]
        opts: list = [None] * len(kvs)

        def wrap(i):
            opts[i] = DistributedOptimizer(torch.optim.Adam(models[i].parameters(), lr=0.01), models[i],
                                           kvstore=kvs[i], update_on_server=True,
                                           sync=sync if isinstance(sync, str) else sync())

        _in_threads([lambda i=i: wrap(i) for i in range(len(kvs))])

        def train(i):
            model, opt = models[i], opts[i]
            for step in range(STEPS):
                x, y = _batch(i, step)
                opt.zero_grad(set_to_none=set_to_none)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if observe is not None:
                    observe(i, step, opt)
            opt.finish()

        workers = range(1, len(kvs))
        _in_threads([lambda i=i: train(i) for i in workers])
        if layouts is not None:
            layouts.update({name: kvs[1]._layout[name][2] for name, _ in opts[1].params})
        return [{k: v.clone() for k, v in models[i].state_dict().items()} for i in workers]
    finally:
        cluster.close()


def test_p3_leaves_the_replies_on_the_wire_at_step_and_ends_on_fsas_model_bit_for_bit():
    on_the_wire: list[int] = []

    def observe(_worker, _step, opt):
        on_the_wire.append(len(opt.sync._landing))      # replies not yet applied when step() returned

    # zeroing .grad in place right after step(), while the round is on its way, changes nothing: P3 sends copies
    p3 = _train("p3", observe, set_to_none=False)
    fsa = _train("fsa")
    for p3_weights, fsa_weights in zip(p3, fsa, strict=True):
        for name, value in fsa_weights.items():
            assert torch.equal(p3_weights[name], value), name
    assert torch.equal(p3[0]["0.weight"], p3[1]["0.weight"])       # both DCs on one model
    assert not torch.equal(p3[0]["0.weight"], _model().state_dict()["0.weight"])      # and it trained
    # six parameters per step were pushed and left to the next forward pass
    assert on_the_wire == [6] * (2 * STEPS)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_p3_with_any_codec_on_both_tiers_ends_on_the_model_of_fsa_with_that_codec(codec):
    """Compression is FSA's, so P3 leaves it alone: the same codec, the same rounds, the same model, for every
    registered codec on the LAN and the WAN. The sampled ones (qsgd, randomk, powersgd, terngrad) draw the same
    numbers in both runs only because each client's reply stream is seeded from its name, not its process id
    (tests/test_inproc.py checks that two runs repeat)."""
    spec = {"lan": codec, "wan": codec, "size_lower_bound": 1}
    p3, fsa = _train("p3", compression=spec), _train("fsa", compression=spec)
    for p3_weights, fsa_weights in zip(p3, fsa, strict=True):
        for name, value in fsa_weights.items():
            assert torch.equal(p3_weights[name], value), name
    start = _model().state_dict()
    assert any(not torch.equal(p3[0][name], start[name]) for name in start)      # and it trained


@pytest.mark.parametrize("compression", [None, {"lan": "qsgd", "wan": "qsgd", "size_lower_bound": 1}],
                         ids=["dense", "qsgd"])
def test_p3_under_mixedsync_lands_the_weights_its_dc_reads_and_ends_on_fsas_model(compression):
    """dist_async (MixedSync, GEOMX_MIXEDSYNC=wait): the global server applies each DC's push as it comes and
    each DC reads its own view, on a reply stream of its own when compressed. With one DC the order is fixed, so
    P3's per-layer landing must give FSA's model bit for bit; with two, both train (their models differ, as
    MixedSync's do)."""
    p3, fsa = _train("p3", mode="dist_async", dcs=("a",), compression=compression), \
        _train("fsa", mode="dist_async", dcs=("a",), compression=compression)
    for name, value in fsa[0].items():
        assert torch.equal(p3[0][name], value), name
    start = _model().state_dict()
    two = _train("p3", mode="dist_async", compression=compression)
    assert all(any(not torch.equal(w[name], start[name]) for name in start) for w in (*p3, *two))


def test_p3_slices_each_parameter_into_keys_of_its_slice_size_and_still_ends_on_fsas_model():
    """Slices of 40 elements: the 16 x 16 weight travels as 8 keys (blocks of whole rows: 2 rows of 16), the
    16 x 8 one as 4 (5 rows of 8, the last 1); the servers' Adam is element-wise, so the model is FSA's."""
    layouts: dict = {}
    p3 = _train(lambda: P3(slice=40), layouts=layouts)
    fsa = _train("fsa")
    for p3_weights, fsa_weights in zip(p3, fsa, strict=True):
        for name, value in fsa_weights.items():
            assert torch.equal(p3_weights[name], value), name
    counts = {name: len(parts) if parts else 1 for name, parts in layouts.items()}
    assert counts["2.weight"] == 8 and counts["0.weight"] == 4 and counts["4.bias"] == 1, counts
    assert all(p.stop - p.start <= 40 for parts in layouts.values() if parts for p in parts)


def test_fsa_pushes_gradients_in_the_order_backward_makes_them_and_p3_starts_with_its_tail_whole(monkeypatch):
    """geomx.sync.wire_order: FSA's gradients cross in the order backward makes them, the last layers highest, each
    parameter at one priority in every worker; P3's do too while its tail holds every byte (its first step); later
    steps' priorities, from the pace of the replies, are
    tests/test_wire_order.py's. The priorities are read where they enter the kvstore."""
    from geomx.kvstore.kvstore import KVStore
    from geomx.sync.wire_order import backward_order

    pushed: dict[int, list[tuple[str, int]]] = {}          # by kvstore
    original = KVStore.pushpull

    def recording(self, key, value, out=None, priority=0, **kw):
        pushed.setdefault(id(self), []).append((key, priority))
        return original(self, key, value, out, priority, **kw)

    monkeypatch.setattr(KVStore, "pushpull", recording)
    fractions: list[float] = []
    _train("fsa")
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    expected = dict(zip(names, backward_order(6), strict=True))
    assert all(prio == expected[key] for pushes in pushed.values() for key, prio in pushes)
    assert len(pushed) == 2 and all(len(pushes) == 6 * STEPS for pushes in pushed.values())
    pushed.clear()
    _train("p3", lambda _worker, _step, opt: fractions.append(opt.sync.order.tail_fraction))
    for pushes in pushed.values():                        # the first step: the tail whole, FSA's order
        assert all(prio == expected[key] for key, prio in pushes[:6])
    assert all(0.0 <= f <= 1.0 for f in fractions) and fractions[0] == 1.0


def test_p3_saves_the_tails_share_and_a_refused_share_leaves_its_state_as_it_was():
    def observe(_worker, step, opt):
        if step == STEPS - 1:
            state = opt.sync.state_dict()
            assert state["tail_fraction"] == opt.sync.order.tail_fraction
            opt.sync.load_state_dict({**state, "tail_fraction": 0.25})
            assert opt.sync.order.tail_fraction == 0.25
            with pytest.raises(ConfigError, match="tail_fraction must be a share of the bytes in \\[0, 1\\], got 1.5"):
                opt.sync.load_state_dict({**state, "steps": 99, "tail_fraction": 1.5})
            assert opt.sync.steps == state["steps"] and opt.sync.order.tail_fraction == 0.25
            saved.append(step)

    saved: list[int] = []
    _train("p3", observe)
    assert saved == [STEPS - 1, STEPS - 1]
    fresh = P3()                                    # loaded before setup: the share waits for the parameters
    fresh.load_state_dict({"algorithm": "p3", "steps": 3, "tail_fraction": 0.5})
    assert fresh.steps == 3 and fresh._saved_tail_fraction == 0.5


def test_p3_reports_each_reply_and_each_end_of_backward_to_its_order(monkeypatch):
    from geomx.sync.wire_order import TailFirst

    calls = {"landed": 0, "end_backward": 0}
    for name in calls:
        original = getattr(TailFirst, name)

        def counting(self, *args, name=name, original=original, **kw):
            calls[name] += 1
            return original(self, *args, **kw)

        monkeypatch.setattr(TailFirst, name, counting)
    _train("p3")
    assert calls == {"landed": 2 * 6 * STEPS, "end_backward": 2 * STEPS}     # 2 workers, 6 parameters


def test_p3_reports_each_part_of_a_sliced_parameter_as_it_lands_with_its_share_of_the_elements(monkeypatch):
    """A parameter in 8 keys lands in 8 replies, each with its own share of the elements (whole rows: the last
    part may be smaller): the order reads the link's pace from parts, since a big parameter's parts land over a
    long time, many of them before backward ends."""
    from geomx.sync.wire_order import TailFirst

    seen: dict[tuple[int, int], list[float]] = {}          # (order, parameter) -> the share each landing held
    original = TailFirst.landed

    def recording(self, i, now, *, share=1.0):
        seen.setdefault((id(self), i), []).append(share)
        return original(self, i, now, share=share)

    monkeypatch.setattr(TailFirst, "landed", recording)
    layouts: dict = {}
    _train(lambda: P3(slice=40), layouts=layouts)
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    shares = [[(p.stop - p.start) / parts[-1].stop for p in parts] if (parts := layouts[name]) else [1.0]
              for name in names]
    assert len(shares[2]) == 8 and shares[1] == [1.0] and shares[0] == [0.3125, 0.3125, 0.3125, 0.0625]
    assert len({order for order, _ in seen}) == 2                                  # both workers
    for (_, i), landed in seen.items():
        assert sorted(landed) == sorted(shares[i] * STEPS), names[i]


def test_p3_is_refused_without_the_servers_optimizer_or_without_the_model_naming_the_fix():
    from geomx.torch import DistributedOptimizer

    cluster = HipsCluster(dcs=("a",), per_dc=1)
    try:
        (kv,) = cluster.workers["a"]
        model = _model()
        errors: dict = {}

        def wrap(name, kvstore, **kw):
            try:
                DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kvstore=kvstore, **kw)
            except ConfigError as exc:
                errors[name] = str(exc)

        # the master worker sets no server optimizer: the worker's p3 has no weights to land
        _in_threads([lambda: wrap("master", cluster.master, named_parameters=model),
                     lambda: wrap("worker", kv, named_parameters=model, sync="p3")])
        assert "it needs the servers' optimizer" in errors["worker"] and "update_on_server=True" in errors["worker"]
    finally:
        cluster.close()
    with pytest.raises(ConfigError, match=r"needs the model: DistributedOptimizer\(optimizer, model"):
        P3().attach_module(None)
    with pytest.raises(ConfigError, match=r"conflicts with no server optimizer"):
        from geomx.compat import check
        check(sync="p3", server_optimizer=False)


def test_enable_p3_selects_p3_as_geomx_documents_and_geomx_sync_wins():
    assert settings_from_env({"ENABLE_P3": "1"}).algorithm == "p3"
    assert settings_from_env({"ENABLE_P3": "1", "GEOMX_P3_SLICE": "1000"}).slice == 1000
    with pytest.raises(ConfigError, match="GEOMX_P3_SLICE"):
        settings_from_env({"GEOMX_SYNC": "p3", "GEOMX_P3_SLICE": "-1"})
    assert settings_from_env({"ENABLE_P3": "1", "GEOMX_SYNC": "fsa"}).algorithm == "fsa"
    assert settings_from_env({}).algorithm == "fsa"


def test_the_device_probe_picks_the_batch_whose_shared_compute_is_nearest_the_transfer_and_that_fits(capsys):
    """tests/scripts/lm_compute_time.py chooses the batches that the GPU's P3 runs use (device_all.sh)."""
    from lm_compute_time import main, pick_batch
    shared = {16: 0.04, 64: 0.09, 256: 0.33, 512: 0.61}
    everything = dict.fromkeys(shared, True)
    assert pick_batch(shared, everything, 0.41) == 256
    assert pick_batch(shared, everything, 1.38) == 512
    assert pick_batch(shared, {**everything, 512: False}, 1.38) == 256
    assert pick_batch(shared, dict.fromkeys(shared, False), 1.38) == 16
    assert main(["--device", "cpu", "--sizes", "tiny", "--batches", "1,2", "--repeats", "1",
                 "--pick", "regional"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines if line.startswith("tiny batch")] == [["tiny", "batch", "1:"],
                                                                                    ["tiny", "batch", "2:"]]
    assert [line.split()[:3] for line in lines if line.startswith("pick")] == [["pick", "tiny", "regional"]]


def test_the_training_scripts_update_on_the_servers_by_default_under_p3_and_on_the_workers_otherwise(monkeypatch):
    """`geomx launch --p3 -- python examples/train_cnn.py` runs as it reads: p3 lands the servers' weights and
    runs no other way, so the scripts' --update-on defaults to server under it (before, every worker failed at
    set-up asking for --update-on server). An explicit --update-on still wins, and is checked as before."""
    import argparse

    from geomx.torch import loop

    for env, expected in (({"GEOMX_SYNC": "p3"}, "server"), ({"ENABLE_P3": "1"}, "server"), ({}, "worker"),
                          ({"GEOMX_SYNC": "hfa"}, "worker"), ({"GEOMX_SYNC": "no-such-algorithm"}, "worker")):
        for var in ("GEOMX_SYNC", "ENABLE_P3", "MXNET_KVSTORE_USE_HFA"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        parser = argparse.ArgumentParser()
        loop.add_arguments(parser, steps=1, steps_help="")
        assert parser.parse_args([]).update_on == expected, env
        assert parser.parse_args(["--update-on", "worker"]).update_on == "worker"
