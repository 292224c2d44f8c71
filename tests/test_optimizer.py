"""DistributedOptimizer as a torch.optim.Optimizer (LR schedulers, zero_grad, state_dict round trips, gradient
accumulation), and the one compatibility table of geomx.compat.

The deployment tests run one real 2-DC deployment (1 worker per DC) for a whole module: the training script
drives several DistributedOptimizers over disjoint keys, each checking one behaviour, with gradients every
worker can recompute, so the expected weights are exact.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import check_ok, launch, load_json, load_npz

OPTIMIZER_SCRIPT = """
import io
import numpy as np
import torch
import geomx, kvhelp as h
from geomx.errors import ConfigError
from geomx.sync import DGA
from geomx.torch import DistributedOptimizer

torch.set_num_threads(1)
kv = geomx.kvstore.create(reduction="mean")
me = h.worker_index()
master = kv.is_master_worker
out, facts = {}, {}


def params(prefix, value=1.0):
    return {f"{prefix}.w": torch.nn.Parameter(torch.full((4,), value)),
            f"{prefix}.b": torch.nn.Parameter(torch.zeros(3))}


def grads(step):        # every worker's gradient of a step, recomputable by the test
    g = torch.Generator().manual_seed(1000 * step + me)
    return [torch.randn(4, generator=g), torch.randn(3, generator=g)]


# 1. an LR scheduler on the DistributedOptimizer steps the wrapped optimizer's learning rate
s = params("s")
sgd = torch.optim.SGD(s.values(), lr=1.0)
opt = DistributedOptimizer(sgd, list(s.items()), kvstore=kv)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
facts["is_optimizer"] = isinstance(opt, torch.optim.Optimizer)
facts["shares_groups"] = opt.param_groups is sgd.param_groups and opt.state is sgd.state
if not master:
    lrs = []
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        facts["zeroed_in_place"] = all(p.grad is None or bool((p.grad == 0).all()) for p in s.values())
        for p in s.values():
            p.grad = torch.full_like(p, float(me + 1))         # the mean over both workers: 1.5
        opt.step()
        sched.step()
        lrs.append(sgd.param_groups[0]["lr"])
    facts["lrs"] = lrs
    out["s.w"] = s["s.w"].detach().numpy().copy()

# 2. backward_passes_per_step=2 sums two backward passes
a = params("a")
opt_a = DistributedOptimizer(torch.optim.SGD(a.values(), lr=1.0), list(a.items()), kvstore=kv,
                             backward_passes_per_step=2)
if not master:
    opt_a.zero_grad()
    (a["a.w"] * 1.0).sum().backward()
    (a["a.w"] * (2.0 + me)).sum().backward()               # sums 3 (worker 0) and 4 (worker 1): mean 3.5
    opt_a.step()
    out["a.w"] = a["a.w"].detach().numpy().copy()

# 3. one backward pass more than backward_passes_per_step is refused, naming the fix
e = params("e")
opt_e = DistributedOptimizer(torch.optim.SGD(e.values(), lr=1.0), list(e.items()), kvstore=kv)
if not master:
    opt_e.zero_grad()
    e["e.w"].sum().backward()
    try:
        e["e.w"].sum().backward()
        facts["second_backward"] = None
    except ConfigError as exc:
        facts["second_backward"] = str(exc)
    opt_e.step()                                           # the first pass's round completes everywhere

# 4. state_dict round trip: A trains, its state goes through torch.save into a fresh twin B, both go on alike
A, B = params("A"), params("B")
opt_A = DistributedOptimizer(torch.optim.Adam(A.values(), lr=0.1), list(A.items()), kvstore=kv, sync=DGA(delay=2))
opt_B = DistributedOptimizer(torch.optim.Adam(B.values(), lr=0.1), list(B.items()), kvstore=kv, sync=DGA(delay=2))
if master:
    raise SystemExit(0)


def train(opt, ps, steps):
    for step in steps:
        opt.zero_grad()
        for p, g in zip(ps.values(), grads(step)):
            p.grad = g
        opt.step()


def history(state):
    return torch.cat([t.flatten() for sent in state["geomx"]["sync"]["history"] for pair in sent for t in pair])


train(opt_A, A, range(3))
saved = opt_A.state_dict()
buf = io.BytesIO()
torch.save(saved, buf)
buf.seek(0)
with torch.no_grad():
    for pa, pb in zip(A.values(), B.values()):
        pb.copy_(pa)
opt_B.load_state_dict(torch.load(buf))
again = opt_B.state_dict()
facts["history_saved"] = len(saved["geomx"]["sync"]["history"])
facts["adam_steps_saved"] = float(saved["state"][0]["step"])
facts["reloaded_equal"] = torch.equal(history(again), history(saved))
for step in range(3, 6):
    train(opt_A, A, [step])
    train(opt_B, B, [step])
for k in ("A.w", "A.b"):
    out[k] = A[k].detach().numpy().copy()
for k in ("B.w", "B.b"):
    out[k] = B[k].detach().numpy().copy()
h.save(f"opt-{me}", out)
h.dump(f"facts-{me}", facts)
"""


@pytest.fixture(scope="module")
def optimizer_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("optimizer")
    run_dir = check_ok(launch(tmp_path, OPTIMIZER_SCRIPT, dcs=2, workers_per_dc=1))
    return [(load_json(run_dir, f"facts-{me}"), load_npz(run_dir, f"opt-{me}")) for me in range(2)]


def test_step_lr_on_a_distributed_optimizer_halves_the_wrapped_learning_rate(optimizer_run):
    for facts, out in optimizer_run:
        assert facts["is_optimizer"] and facts["shares_groups"]
        assert facts["lrs"] == [0.5, 0.25, 0.125]
        assert facts["zeroed_in_place"]
        # steps at lr 1, 0.5, 0.25 on the mean gradient 1.5
        np.testing.assert_allclose(out["s.w"], 1.0 - 1.5 * (1 + 0.5 + 0.25), rtol=1e-6)


def test_backward_passes_per_step_sums_the_passes(optimizer_run):
    for _, out in optimizer_run:
        np.testing.assert_allclose(out["a.w"], 1.0 - 3.5, rtol=1e-6)


def test_a_backward_pass_too_many_is_refused_naming_the_option(optimizer_run):
    for facts, _ in optimizer_run:
        message = facts["second_backward"]
        assert message is not None and "'e.w'" in message and "backward_passes_per_step=2" in message, message


def test_state_dict_round_trip_continues_bit_identically(optimizer_run):
    for facts, out in optimizer_run:
        assert facts["history_saved"] == 2 and facts["adam_steps_saved"] == 3.0 and facts["reloaded_equal"]
        for name in ("w", "b"):
            assert np.array_equal(out[f"A.{name}"], out[f"B.{name}"]), name
            assert not np.array_equal(out[f"A.{name}"], np.full_like(out[f"A.{name}"], 1.0 if name == "w" else 0.0))


# the compatibility table -------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings,pair", [
    ({"mode": "dist_sync", "mixedsync": "overlap"}, ["--mixedsync overlap", "mode 'dist_sync'"]),
    ({"topology": "flat", "mixedsync": "overlap"}, ["--mixedsync overlap", "topology 'flat'"]),
    ({"mixedsync": "overlap", "server_optimizer": True}, ["--mixedsync overlap", "a server optimizer"]),
    ({"mode": "dist_async", "sync": "dga"}, ["sync 'dga'", "mode 'dist_async'"]),
    ({"sync": "esync", "server_optimizer": True}, ["sync 'esync'", "a server optimizer"]),
    ({"sync": "diloco", "topology": "flat", "k2": 3}, ["sync 'diloco'", "topology 'flat'", "K2 = 3"]),
    ({"sync": "hfa", "backward_passes_per_step": 2}, ["sync 'hfa'", "backward_passes_per_step=2"]),
    ({"sync": "p3", "mixedsync": "overlap"}, ["sync 'p3'", "--mixedsync overlap", "use --mixedsync wait"]),
])
def test_a_conflict_names_both_settings(settings, pair):
    from geomx.compat import check, conflict
    from geomx.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        check(**settings)
    message = str(err.value)
    assert message.index(pair[0]) < message.index(" conflicts with ") < message.index(pair[1]), message
    for words in pair[2:]:
        assert words in message
    # every setting alone, or with a setting it combines with, passes
    for key, value in settings.items():
        assert conflict(**{key: value}) is None
    assert conflict(mode="dist_async", mixedsync="overlap", topology="hips", sync="fsa", server_optimizer=False,
                    compression=True, backward_passes_per_step=4) is None


def test_distributed_optimizer_refuses_a_conflict_before_joining_anything():
    from geomx.errors import ConfigError
    from geomx.sync import ESync
    from geomx.torch import DistributedOptimizer

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError, match=r"sync 'hfa' .* conflicts with a server optimizer"):
        DistributedOptimizer(sgd, sync="hfa", update_on_server=True)
    with pytest.raises(ConfigError, match=r"sync 'dga' .* conflicts with backward_passes_per_step=3"):
        DistributedOptimizer(sgd, sync="dga", backward_passes_per_step=3)
    with pytest.raises(ConfigError, match=r"sync 'esync' .* conflicts with backward_passes_per_step=2"):
        DistributedOptimizer(sgd, sync=ESync(steps=2), backward_passes_per_step=2)
    with pytest.raises(ConfigError, match="backward_passes_per_step must be a whole number >= 1"):
        DistributedOptimizer(sgd, backward_passes_per_step=0)


def test_one_policy_object_serves_one_distributed_optimizer():
    """A policy holds one optimizer's state (its parameters, DGA's history, HFA's base model): two optimizers
    sharing sync=policy mixed theirs (a review saw such a pair hang). The second is refused while the first
    lives; once it is gone the object may serve again."""
    import gc

    from geomx.errors import ConfigError
    from geomx.sync import DGA
    from geomx.torch import DistributedOptimizer
    from geomx.torch import optimizer as optimizer_module

    class Earlier:      # stands for a DistributedOptimizer already built with the policy
        pass

    policy, earlier = DGA(delay=1), Earlier()
    optimizer_module._claim(policy, earlier)
    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"sync=DGA\(.*\) already serves another DistributedOptimizer; give each"):
        DistributedOptimizer(sgd, sync=policy)
    del earlier
    gc.collect()
    optimizer_module._claim(policy, Earlier())       # the first is gone: no refusal


def test_backward_passes_per_step_beside_a_policy_object_is_checked_and_must_be_the_objects_own():
    """sync=geomx.FSA() with backward_passes_per_step=2 had summed one pass, and step() then asked for the
    backward_passes_per_step=2 the user had given; 0 was taken. Both are refused before joining anything."""
    from geomx.errors import ConfigError
    from geomx.sync import FSA, P3, create
    from geomx.torch import DistributedOptimizer

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError) as err:
        DistributedOptimizer(sgd, sync=FSA(), backward_passes_per_step=2)
    for words in ("backward_passes_per_step=2 was given to DistributedOptimizer",
                  "sync=FSA(backward_passes_per_step=1) sums backward_passes_per_step=1",
                  "FSA(backward_passes_per_step=2)"):
        assert words in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r"backward_passes_per_step=1 was given.*sums backward_passes_per_step=3"):
        DistributedOptimizer(sgd, sync=P3(backward_passes_per_step=3), backward_passes_per_step=1)
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match=rf"backward_passes_per_step must be a whole number >= 1, got {bad}"):
            DistributedOptimizer(sgd, sync=FSA(), backward_passes_per_step=bad)
    with pytest.raises(ConfigError, match=r"takes no backward_passes_per_step"):
        create(type("Own", (), {"setup": print, "step": print})(), backward_passes_per_step=2)
    # the object's own, given alone or given alike in both places
    for passes in (None, 2):
        assert create(FSA(backward_passes_per_step=2), backward_passes_per_step=passes).backward_passes_per_step == 2


def test_geomx_launch_refuses_a_worker_side_sync_in_dist_async(capsys):
    from geomx.cli.main import main

    assert main(["launch", "--mode", "dist_async", "--sync", "hfa", "--", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "sync 'hfa'" in err and "conflicts with mode 'dist_async'" in err, err


def test_geomx_launch_takes_p3_as_a_flag_of_its_own_and_refuses_what_p3_cannot_run_with(capsys, monkeypatch):
    """--p3 (the issue's and GeoMX users' spelling) is --sync p3; before, argparse read it as an abbreviation of
    --p3-slice and asked for a number. P3 needs the servers' optimizer, which MixedSync 'overlap' cannot run:
    refused before anything starts, as --sync p3 is."""
    import geomx.cli.main as cli
    from geomx.cli.main import main

    launched = {}
    monkeypatch.setattr(cli, "cmd_launch", lambda args: launched.update(cli.topology_from_args(args).env) or 0)
    assert main(["launch", "--p3", "--p3-slice", "1000", "--", "python", "x.py"]) == 0
    assert launched["GEOMX_SYNC"] == "p3" and launched["GEOMX_P3_SLICE"] == "1000", launched
    monkeypatch.undo()

    for flags in (["--p3"], ["--sync", "p3"]):
        assert main(["launch", *flags, "--mode", "dist_async", "--mixedsync", "overlap", "--", "python", "x.py"]) == 2
        err = capsys.readouterr().err
        assert "sync 'p3'" in err and "conflicts with --mixedsync overlap" in err, err
    with pytest.raises(SystemExit):     # one algorithm: --p3 with another --sync is an argparse error
        main(["launch", "--p3", "--sync", "hfa", "--", "python", "x.py"])
    assert "not allowed with argument" in capsys.readouterr().err


# policies' state without a deployment ------------------------------------------------------------------------
def _diloco(values: list[torch.Tensor]):
    from geomx.sync import DiLoCo

    policy = DiLoCo(k1=1, k2=1)
    policy.params = [(f"p{i}", torch.nn.Parameter(v.clone())) for i, v in enumerate(values)]
    policy.dc_scale = policy.global_scale = 1.0        # what setup() learns from the deployment
    policy.start()
    return policy


def test_diloco_state_round_trip_keeps_its_outer_momentum_bit_identically():
    import io

    from geomx.errors import ConfigError
    from geomx.sync import DGA

    g = torch.Generator().manual_seed(7)
    averages = [[torch.randn(5, generator=g), torch.randn(2, 3, generator=g)] for _ in range(6)]
    first = _diloco([torch.zeros(5), torch.zeros(2, 3)])
    for avg in averages[:3]:
        first.adopt(avg)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    current = [p.detach() for _, p in first.params]
    restored, forgetful = _diloco(current), _diloco(current)
    restored.load_state_dict(torch.load(buf))
    for avg in averages[3:]:
        for policy in (first, restored, forgetful):
            policy.adopt(avg)
    for (_, a), (_, b), (_, c) in zip(first.params, restored.params, forgetful.params, strict=True):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)          # without the outer momentum the run goes elsewhere
    with pytest.raises(ConfigError, match="'diloco'.*'dga'"):
        DGA(delay=1).load_state_dict(first.state_dict())


def test_a_learning_rate_schedule_on_the_workers_is_said_not_to_reach_the_servers_optimizer():
    """With update_on_server=True the global servers run the optimizer with the hyper-parameters it had at
    set-up. An LR scheduler on the workers changed their param_groups and nothing else, silently; the first
    step() after the change now warns, naming the group and both rates, once. Without a change, no warning."""
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    from geomx.torch import DistributedOptimizer
    from inproc import DEADLINE_S, HipsCluster

    def make(kv):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, kvstore=kv,
                                    update_on_server=True), model

    def train(opt, model, steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                opt.zero_grad()
                model(torch.ones(2, 3)).sum().backward()
                opt.step()
        return [str(w.message) for w in caught]

    cluster = HipsCluster(dcs=("a",), per_dc=1)
    try:
        with ThreadPoolExecutor(2) as pool:
            (_, _), (opt, model) = [f.result(DEADLINE_S) for f in
                                    [pool.submit(make, kv) for kv in (cluster.master, cluster.workers["a"][0])]]
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        assert train(opt, model, 2) == []
        schedule.step()
        said = train(opt, model, 3)
    finally:
        cluster.close()
    assert len(said) == 1, said
    assert "parameter group 0 is 0.05 on this worker" in said[0] and "(0.1)" in said[0], said
    assert "server_lr_schedule=geomx.WarmupCosine" in said[0], said


def test_a_server_lr_schedule_steps_the_servers_optimizer_as_a_scheduler_steps_a_local_one():
    """DistributedOptimizer(server_lr_schedule=...) gives the global servers the schedule (MXNet's servers ran
    the optimizer's scheduler): one worker's model after 4 steps equals local SGD under torch's StepLR."""
    from concurrent.futures import ThreadPoolExecutor

    from geomx.optim import StepDecay
    from geomx.torch import DistributedOptimizer
    from inproc import DEADLINE_S, HipsCluster

    def model_and_sgd():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)

    def make(kv, model, sgd):
        return DistributedOptimizer(sgd, model, kvstore=kv, update_on_server=True,
                                    server_lr_schedule=StepDecay(step_size=1, gamma=0.5)), model

    def train(opt, model, steps):
        for i in range(steps):
            opt.zero_grad()
            model(torch.full((2, 3), 1.0 + i)).pow(2).sum().backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    cluster = HipsCluster(dcs=("a",), per_dc=1)
    try:
        with ThreadPoolExecutor(2) as pool:
            # the models made here, one after the other: torch's seed is one for all threads
            made = [(kv, *model_and_sgd()) for kv in (cluster.master, cluster.workers["a"][0])]
            (_, _), (opt, model) = [f.result(DEADLINE_S) for f in [pool.submit(make, *m) for m in made]]
        distributed = train(opt, model, 4)
    finally:
        cluster.close()
    def local(gamma):
        model, sgd = model_and_sgd()
        scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=gamma)
        for i in range(4):
            sgd.zero_grad()
            model(torch.full((2, 3), 1.0 + i)).pow(2).sum().backward()
            sgd.step()
            scheduler.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    torch.testing.assert_close(distributed, local(0.5), rtol=0, atol=1e-6)
    assert (local(0.5) - local(1.0)).abs().max() > 1e-2     # at the constant rate it would end elsewhere


def test_a_workers_server_lr_schedule_other_than_the_master_workers_is_refused_naming_both():
    """Only the master worker's schedule reaches the servers (GeoMX's set_optimizer): a worker passing another
    had trained believing in a schedule the servers did not run."""
    from concurrent.futures import ThreadPoolExecutor

    from geomx.errors import ConfigError
    from geomx.optim import StepDecay
    from geomx.torch import DistributedOptimizer
    from inproc import DEADLINE_S, HipsCluster

    def make(kv, model, schedule):
        return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, kvstore=kv,
                                    update_on_server=True, server_lr_schedule=schedule)

    cluster = HipsCluster(dcs=("a",), per_dc=1)
    try:
        models = [torch.nn.Linear(3, 1) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            master = pool.submit(make, cluster.master, models[0], StepDecay(step_size=1, gamma=0.5))
            worker = pool.submit(make, cluster.workers["a"][0], models[1], StepDecay(step_size=2, gamma=0.5))
            master.result(DEADLINE_S)
            with pytest.raises(ConfigError, match=r"server_lr_schedule=StepDecay\(step_size=2, gamma=0.5\) on this "
                                                  r"worker, but the global servers run \{'name': 'step', "
                                                  r"'step_size': 1, 'gamma': 0.5\} \(the master worker's\)"):
                worker.result(DEADLINE_S)
    finally:
        cluster.close()


def test_parameter_groups_the_servers_optimizer_does_not_run_are_named_at_set_up(caplog):
    """The servers' optimizer is built from the wrapped optimizer's defaults, one set for every key: a group
    with its own learning rate or weight decay (no decay on biases, a common recipe) is not applied there, which
    DistributedOptimizer now says at set-up (a log warning and a Python warning), naming the group and what
    differs. One set for all: nothing said."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    from geomx.torch import DistributedOptimizer
    from inproc import DEADLINE_S, HipsCluster

    def make(kv, split: bool):
        model = torch.nn.Linear(3, 1)
        groups = ([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0, "lr": 0.5}] if split
                  else model.parameters())
        DistributedOptimizer(torch.optim.AdamW(groups, lr=0.1, weight_decay=0.01), model, kvstore=kv,
                             update_on_server=True)

    for split in (False, True):
        caplog.clear()
        cluster = HipsCluster(dcs=("a",), per_dc=1)
        try:
            with caplog.at_level(logging.WARNING, logger="geomx.optimizer"), ThreadPoolExecutor(2) as pool:
                for f in [pool.submit(make, kv, split) for kv in (cluster.master, cluster.workers["a"][0])]:
                    f.result(DEADLINE_S)
        finally:
            cluster.close()
        said = [r.getMessage() for r in caplog.records if r.name == "geomx.optimizer"]
        if not split:
            assert said == [], said
            continue
        assert len(said) == 2, said         # the master worker and the worker
        assert all("parameter group 1's {'lr': 0.5, 'weight_decay': 0.0} are not applied there" in m
                   and "the optimizer's defaults ({'lr': 0.1" in m for m in said), said


def test_a_state_saved_with_the_servers_optimizer_is_refused_by_one_without_it_and_the_other_way_round():
    """Resuming a run whose servers ran the optimizer without --update-on server went on, exit code 0, from
    optimizer state that was never the model's (a reviewer's run lost 5 points of accuracy); the other way round
    the workers' moments were dropped. Both are refused, naming --update-on."""
    from concurrent.futures import ThreadPoolExecutor

    from geomx.errors import ConfigError
    from geomx.torch import DistributedOptimizer
    from inproc import DEADLINE_S, HipsCluster

    def worker_state(on_server: bool) -> tuple:
        def make(kv):
            model = torch.nn.Linear(3, 1)
            return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, kvstore=kv,
                                        update_on_server=on_server)

        cluster = HipsCluster(dcs=("a",), per_dc=1)
        with ThreadPoolExecutor(2) as pool:
            _, opt = [f.result(DEADLINE_S) for f in [pool.submit(make, kv)
                                                    for kv in (cluster.master, cluster.workers["a"][0])]]
        return cluster, opt

    clusters = []
    try:
        (c1, on_server), (c2, on_workers) = worker_state(True), worker_state(False)
        clusters += [c1, c2]
        for saved, loader, where in ((on_server, on_workers, "--update-on server"),
                                     (on_workers, on_server, "--update-on worker")):
            with pytest.raises(ConfigError, match="resume with the --update-on") as refused:
                loader.load_state_dict(saved.state_dict())
            assert where in str(refused.value)
        on_workers.load_state_dict(on_workers.state_dict())       # the same set-up loads
    finally:
        for cluster in clusters:
            cluster.close()
