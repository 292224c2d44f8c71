"""Synchronization pieces that need no deployment: --slowdown and --sync parsing, the slowdown itself, DCASGD."""
from __future__ import annotations

import time

import pytest
import torch

from geomx.cli.launch import plan
from geomx.cli.main import main
from geomx.cli.topology import load_topology
from geomx.errors import ConfigError
from geomx.optim import DCASGD
from geomx.sync import create, settings_from_env
from geomx.sync.fusion import Fusion, GradientBuckets
from geomx.sync.slowdown import Slowdown


# --slowdown -------------------------------------------------------------------------------------------------
def test_slowdown_reaches_exactly_the_chosen_workers(tmp_path):
    topo = load_topology(None, dcs=2, workers_per_dc=[2, 3], slowdown=["b=3", "a:1=2.5", "b:2=4"])
    assert topo.slowdown == {("a", 1): 2.5, ("b", 0): 3.0, ("b", 1): 3.0, ("b", 2): 4.0}
    specs = {s.name: s.env for s in plan(topo, ["python", "x.py"], tmp_path, ports=list(range(20000, 20005)))}
    assert "GEOMX_SLOWDOWN" not in specs["a-worker-0"] and specs["a-worker-1"]["GEOMX_SLOWDOWN"] == "2.5"
    assert [specs[f"b-worker-{r}"]["GEOMX_SLOWDOWN"] for r in range(3)] == ["3.0", "3.0", "4.0"]
    assert not any("GEOMX_SLOWDOWN" in env for name, env in specs.items() if "worker" not in name)


def test_slowdown_from_a_toml_table(tmp_path):
    path = tmp_path / "topo.toml"
    path.write_text('dcs = 2\nworkers_per_dc = 1\nslowdown = { b = 3 }\n')
    assert load_topology(str(path)).slowdown == {("b", 0): 3.0}


@pytest.mark.parametrize("entry,words", [
    ("c=2", ["no DC 'c'", "a, b"]),
    ("a:2=2", ["DC a has no worker of rank '2'", "ranks 0-1"]),
    ("a:x=2", ["rank 'x'"]),
    ("b=0.5", ["'b=0.5'", ">= 1"]),
    ("b=fast", ["'b=fast'", "not a number"]),
    ("b", ["expected DC[:RANK]=FACTOR"]),
])
def test_bad_slowdown_is_refused_naming_the_dc_or_rank(entry, words):
    with pytest.raises(ConfigError) as err:
        load_topology(None, dcs=2, workers_per_dc=2, slowdown=[entry])
    for w in words:
        assert w in str(err.value), str(err.value)


def test_geomx_launch_rejects_a_bad_slowdown_before_starting_anything(capsys):
    assert main(["launch", "--slowdown", "z:0=3", "--", "python", "x.py"]) == 2
    assert "no DC 'z'" in capsys.readouterr().err


def test_slowdown_sleeps_factor_minus_one_times_the_measured_compute():
    s = Slowdown(factor=3)
    s.compute_starts()
    time.sleep(0.05)                     # "compute"
    started = time.perf_counter()
    step_s = s.pause()                   # the compute measured, the sleep included
    slept = time.perf_counter() - started
    # twice the compute it measured (at least the 50 ms slept: a loaded machine may oversleep, never undersleep)
    assert s.slept_s == pytest.approx(2 / 3 * step_s) and s.slept_s >= 0.1 and slept >= s.slept_s
    assert Slowdown.from_env({}).factor == 1.0 and Slowdown.from_env({"GEOMX_SLOWDOWN": "2"}).factor == 2.0
    with pytest.raises(ConfigError, match="GEOMX_SLOWDOWN"):
        Slowdown.from_env({"GEOMX_SLOWDOWN": "-1"})


# --sync ------------------------------------------------------------------------------------------------------
def test_sync_settings_from_geomx_variables_and_from_the_launcher():
    s = settings_from_env({"MXNET_KVSTORE_USE_HFA": "1", "MXNET_KVSTORE_HFA_K1": "20", "MXNET_KVSTORE_HFA_K2": "10"})
    assert (s.algorithm, s.k1, s.k2, s.weights) == ("hfa", 20, 10, "samples")
    assert settings_from_env({}).algorithm == "fsa"
    topo = load_topology(None, sync="diloco", sync_k1=4, sync_k2=2)
    assert topo.env["GEOMX_SYNC"] == "diloco" and topo.env["MXNET_KVSTORE_HFA_K1"] == "4"
    assert topo.env["MXNET_KVSTORE_USE_HFA"] == "1" and topo.env["GEOMX_DILOCO_LR"] == "0.7"
    s = settings_from_env(topo.env)
    assert (s.algorithm, s.k1, s.k2, s.outer_lr, s.outer_momentum) == ("diloco", 4, 2, 0.7, 0.9)
    assert s.dc_overlap == 0
    overlapped = settings_from_env(load_topology(None, sync="hfa", sync_k2=5, sync_dc_overlap=1).env)
    assert (overlapped.k2, overlapped.dc_overlap) == (5, 1)


def test_sync_table_in_toml(tmp_path):
    path = tmp_path / "topo.toml"
    path.write_text('sync = { algorithm = "hfa", k1 = 20, k2 = 10, weights = "equal", dc_overlap = 1 }\n')
    env = load_topology(str(path)).env
    assert (env["GEOMX_SYNC"], env["MXNET_KVSTORE_HFA_K1"], env["MXNET_KVSTORE_HFA_K2"],
            env["GEOMX_HFA_WEIGHTS"], env["GEOMX_HFA_DC_OVERLAP"]) == ("hfa", "20", "10", "equal", "1")
    path.write_text('sync = { algorithm = "hfa", k1 = 0 }\n')
    with pytest.raises(ConfigError, match=r"K1 \(MXNET_KVSTORE_HFA_K1\) in .*topo.toml must be >= 1"):
        load_topology(str(path))


@pytest.mark.parametrize("flag,option,goes_with", [
    ("--hfa-k1", "sync_k1", "--hfa-k1 goes with --sync hfa or diloco"),
    ("--hfa-dc-sync", "sync_dc_sync", "--hfa-dc-sync goes with --sync hfa or diloco"),
    ("--dga-delay", "sync_delay", "--dga-delay goes with --sync dga"),
    ("--esync-steps", "sync_steps", "--esync-steps goes with --sync esync"),
    ("--p3-slice", "sync_slice", "--p3-slice goes with --sync p3"),
])
def test_a_sync_sub_option_without_sync_is_refused_naming_the_flag_and_its_algorithms(flag, option, goes_with,
                                                                                      capsys):
    # it used to switch the run to HFA silently (--hfa-*), or refuse dga/esync/p3 options as not HFA's
    value = "models" if option == "sync_dc_sync" else "3"
    with pytest.raises(ConfigError, match=f"^{goes_with}, and no --sync was given$"):
        load_topology(None, **{option: value})
    assert main(["launch", flag, value, "--", "python", "x.py"]) == 2
    assert capsys.readouterr().err == f"geomx: error: {goes_with}, and no --sync was given\n"


def test_a_sync_sub_option_of_another_algorithm_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="^--hfa-k1 goes with --sync hfa or diloco, not fsa$"):
        load_topology(None, sync="fsa", sync_k1=5)
    with pytest.raises(ConfigError, match="--dga-delay goes with --sync dga; --esync-steps goes with --sync esync, "
                                          "not hfa"):
        load_topology(None, sync="hfa", sync_delay=3, sync_steps=2)


def test_sync_sub_options_with_their_algorithm_reach_the_environment_p3_alias_included(monkeypatch):
    import geomx.cli.main as cli

    envs = []
    monkeypatch.setattr(cli, "cmd_launch", lambda args: envs.append(cli.topology_from_args(args).env) or 0)
    for flags in (["--p3", "--p3-slice", "1000"], ["--sync", "dga", "--dga-delay", "3"],
                  ["--sync", "esync", "--esync-steps", "4"], ["--sync", "diloco", "--hfa-k1", "5"]):
        assert main(["launch", *flags, "--", "python", "x.py"]) == 0
    assert [(e["GEOMX_SYNC"], e.get("GEOMX_P3_SLICE"), e.get("GEOMX_DGA_DELAY"), e.get("GEOMX_ESYNC_STEPS"),
             e.get("MXNET_KVSTORE_HFA_K1")) for e in envs] == [("p3", "1000", None, None, None),
                                                               ("dga", None, "3", None, None),
                                                               ("esync", None, None, "4", None),
                                                               ("diloco", None, None, None, "5")]


@pytest.mark.parametrize("table,words", [
    ("{ k1 = 20 }", ["sync option 'k1' in", "topo.toml", 'goes with algorithm = "hfa" or "diloco"',
                     "names no algorithm"]),
    ("{ delay = 3 }", ["sync option 'delay'", 'goes with algorithm = "dga"', "names no algorithm"]),
    ("{ k3 = 1 }", ["has no option 'k3'", "k1, k2"]),
])
def test_a_toml_sync_table_with_options_and_no_algorithm_is_refused_naming_the_option(tmp_path, table, words):
    path = tmp_path / "topo.toml"
    path.write_text(f"sync = {table}\n")
    with pytest.raises(ConfigError) as err:
        load_topology(str(path))
    for w in words:
        assert w in str(err.value), str(err.value)


def test_resuming_with_another_algorithm_names_both_algorithms_cleanly():
    from geomx.sync import HFA

    with pytest.raises(ConfigError) as err:
        HFA().load_state_dict({"algorithm": "fsa", "steps": 3})
    assert str(err.value) == ("the checkpoint holds the state of synchronization 'fsa', but this optimizer runs "
                              "'hfa': resume with the same --sync")


@pytest.mark.parametrize("env,words", [
    ({"MXNET_KVSTORE_USE_HFA": "1", "MXNET_KVSTORE_HFA_K1": "0"}, ["K1 (MXNET_KVSTORE_HFA_K1)", ">= 1", "got 0"]),
    ({"GEOMX_SYNC": "hfa", "MXNET_KVSTORE_HFA_K2": "-3"}, ["K2 (MXNET_KVSTORE_HFA_K2)", "got -3"]),
    ({"GEOMX_SYNC": "hfa", "MXNET_KVSTORE_HFA_K1": "2.5"}, ["MXNET_KVSTORE_HFA_K1", "whole number"]),
    ({"GEOMX_SYNC": "esgd"}, ["GEOMX_SYNC='esgd'", "fsa, p3, hfa, diloco, dga, esync"]),
    ({"GEOMX_SYNC": "diloco", "GEOMX_DILOCO_MOMENTUM": "1"}, ["GEOMX_DILOCO_MOMENTUM", "[0, 1)"]),
    ({"GEOMX_SYNC": "hfa", "GEOMX_HFA_WEIGHTS": "size"}, ["GEOMX_HFA_WEIGHTS", "samples, equal"]),
    ({"GEOMX_SYNC": "dga", "GEOMX_DGA_DELAY": "-1"}, ["dga delay D (GEOMX_DGA_DELAY)", ">= 0", "got -1"]),
    ({"GEOMX_SYNC": "esync", "GEOMX_ESYNC_STEPS": "0"}, ["esync steps (GEOMX_ESYNC_STEPS)", ">= 1", "got 0"]),
    ({"GEOMX_SYNC": "hfa", "MXNET_KVSTORE_HFA_K2": "4", "GEOMX_HFA_OVERLAP": "17"},
     ["hfa overlap (GEOMX_HFA_OVERLAP)", "[0, 4 x K2 = 16]", "got 17"]),
    ({"GEOMX_SYNC": "hfa", "GEOMX_HFA_OVERLAP_KEEP": "1.5"}, ["overlap_keep (GEOMX_HFA_OVERLAP_KEEP)", "[0, 1]",
                                                              "got 1.5"]),
    ({"GEOMX_SYNC": "diloco", "GEOMX_HFA_OVERLAP_KEEP": "half"}, ["GEOMX_HFA_OVERLAP_KEEP", "must be a number"]),
    ({"GEOMX_SYNC": "hfa", "GEOMX_HFA_DC_SYNC": "grads"}, ["GEOMX_HFA_DC_SYNC", "models, gradients", "'grads'"]),
    ({"GEOMX_SYNC": "diloco", "GEOMX_HFA_DC_SYNC": "gradients", "MXNET_KVSTORE_HFA_K1": "5"},
     ["dc_sync=gradients (GEOMX_HFA_DC_SYNC)", "K1 (MXNET_KVSTORE_HFA_K1) must be 1", "got 5"]),
    ({"GEOMX_SYNC": "hfa", "MXNET_KVSTORE_HFA_K2": "4", "GEOMX_HFA_DC_OVERLAP": "2"},
     ["hfa dc_overlap (GEOMX_HFA_DC_OVERLAP)", "must be in [0, K1 = 1]", "got 2"]),
    ({"GEOMX_SYNC": "hfa", "MXNET_KVSTORE_HFA_K1": "5", "MXNET_KVSTORE_HFA_K2": "2", "GEOMX_HFA_DC_OVERLAP": "6"},
     ["hfa dc_overlap (GEOMX_HFA_DC_OVERLAP)", "must be in [0, K1 = 5]", "got 6"]),
    ({"GEOMX_SYNC": "hfa", "MXNET_KVSTORE_HFA_K2": "4", "GEOMX_HFA_DC_OVERLAP": "1", "GEOMX_HFA_DC_SYNC": "gradients"},
     ["dc_overlap (GEOMX_HFA_DC_OVERLAP)", "dc_sync='gradients' (GEOMX_HFA_DC_SYNC)", "use dc_sync=models"]),
    ({"GEOMX_SYNC": "diloco", "GEOMX_HFA_DC_OVERLAP": "1"}, ["diloco dc_overlap (GEOMX_HFA_DC_OVERLAP)",
                                                           "K2 (MXNET_KVSTORE_HFA_K2) = 1", "K2 >= 2"]),
    ({"GEOMX_SYNC": "dga", "GEOMX_HFA_OVERLAP": "1"}, []),       # another algorithm's variable is not read
])
def test_bad_sync_settings_are_refused_naming_the_variable(env, words):
    if not words:
        assert settings_from_env(env).overlap == 0
        return
    with pytest.raises(ConfigError) as err:
        settings_from_env(env)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_k1_below_one_is_refused_by_the_class_and_by_geomx_launch(capsys):
    from geomx.sync import HFA

    with pytest.raises(ConfigError, match="K1"):
        HFA(k1=0)
    assert main(["launch", "--sync", "hfa", "--hfa-k1", "0", "--", "python", "x.py"]) == 2
    assert "hfa K1 (MXNET_KVSTORE_HFA_K1) must be >= 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="setup"):
        create(object())


@pytest.mark.parametrize("policy,options,words", [
    ("P3", {"slice": -1}, ["p3 slice (GEOMX_P3_SLICE)", ">= 0", "got -1"]),
    ("DiLoCo", {"outer_lr": float("inf")}, ["outer_lr (GEOMX_DILOCO_LR)", "finite", "got inf"]),
    ("DiLoCo", {"outer_lr": float("nan")}, ["outer_lr (GEOMX_DILOCO_LR)", "got nan"]),
])
def test_a_policy_object_refuses_what_geomx_launch_refuses_naming_the_option(policy, options, words):
    """P3(slice=-1) had been taken in code while --p3-slice -5 was refused; an infinite outer_lr had been taken
    where NaN was refused."""
    import geomx.sync

    with pytest.raises(ConfigError) as err:
        getattr(geomx.sync, policy)(**options)
    for w in words:
        assert w in str(err.value), str(err.value)


@pytest.mark.parametrize("env,var", [
    ({"GEOMX_SYNC": "hfa", "MXNET_KVSTORE_HFA_K1": "5", "MXNET_KVSTORE_HFA_K2": "4"}, "GEOMX_SYNC='hfa'"),
    ({"MXNET_KVSTORE_USE_HFA": "1"}, "MXNET_KVSTORE_USE_HFA='1'"),
])
@pytest.mark.parametrize("spec", ["diloco", "dga", "fsa"])
def test_a_sync_name_other_than_the_launchers_algorithm_is_refused_naming_both(monkeypatch, env, var, spec):
    """geomx launch --sync hfa --hfa-k1 5 --hfa-k2 4 with a script's sync="diloco" had trained DiLoCo with
    K1 = K2 = 1 (and sync="dga" DGA with delay 1) while the launcher checked and reported HFA."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        create(spec)
    for words in (f"sync={spec!r}", f"deployment's hfa ({var}", f"--sync {spec}", "leave sync= out"):
        assert words in str(err.value), str(err.value)
    assert (create("hfa").k1, create(None).k1) == ((5, 5) if "MXNET_KVSTORE_HFA_K1" in env else (1, 1))


def test_a_policy_object_of_another_algorithm_than_the_launchers_is_refused_and_its_own_options_stay(monkeypatch):
    """geomx launch --sync hfa with a script's sync=geomx.DiLoCo(...): the launcher had checked and configured
    HFA while the workers ran DiLoCo. An object of the launcher's algorithm keeps its own options, as documented."""
    from geomx.sync import DGA, HFA

    monkeypatch.setenv("GEOMX_SYNC", "hfa")
    with pytest.raises(ConfigError, match=r"runs dga, but the deployment runs hfa \(GEOMX_SYNC='hfa', which geomx "
                                          r"launch --sync sets\): launch with --sync dga"):
        create(DGA(delay=2))
    assert create(HFA(k1=3, k2=2)).k1 == 3
    monkeypatch.delenv("GEOMX_SYNC")
    assert create(DGA(delay=2)).delay == 2


def test_a_sync_name_where_the_environment_names_no_algorithm_takes_its_defaults(monkeypatch):
    for name in ("GEOMX_SYNC", "MXNET_KVSTORE_USE_HFA", "ENABLE_P3"):
        monkeypatch.delenv(name, raising=False)
    assert (create("diloco").k1, create("dga").delay) == (1, 1)


def test_dc_gradient_averages_are_refused_on_the_flat_topology_naming_it():
    from types import SimpleNamespace

    from geomx.sync import HFA

    kv = SimpleNamespace(type="dist_sync", cfg=SimpleNamespace(topology="flat"), server_updates=False)
    with pytest.raises(ConfigError, match=r"dc_sync='gradients' \(GEOMX_HFA_DC_SYNC\).*'flat' topology"):
        HFA(k2=1, dc_sync="gradients").setup(kv, [])


# DCASGD ------------------------------------------------------------------------------------------------------
def _pair(**kwargs):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(40))
    b = torch.nn.Parameter(a.detach().clone())
    return a, b


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 1e-2)])
def test_dcasgd_with_lambda_zero_is_sgd_bit_for_bit(momentum, wd):
    a, b = _pair()
    dc = DCASGD([a], lr=0.1, momentum=momentum, lamda=0.0, weight_decay=wd)
    sgd = torch.optim.SGD([b], lr=0.1, momentum=momentum, weight_decay=wd)
    for i in range(6):
        g = torch.randn(40)
        a.grad, b.grad = g.clone(), g.clone()
        dc.set_sender("a" if i % 3 else "b")
        dc.step()
        sgd.step()
        assert torch.equal(a, b), i


def test_dcasgd_compensates_each_sender_against_its_own_backup():
    """Float64 reference of the paper's rule: w_bak[sender] = the weights that sender read after its update."""
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(30, dtype=torch.float64))
    lr, lam, mom = 0.1, 0.5, 0.9
    opt = DCASGD([w], lr=lr, lamda=lam, momentum=mom)
    ref, buf, backup = w.detach().clone(), None, {}
    init = ref.clone()
    prev_server = None
    for i, sender in enumerate(["a", "b", "b", "a", "c", "a"]):
        g = torch.randn(30, dtype=torch.float64)
        bak = backup.get(sender, init)
        if i == 3:   # DC a read its weights two updates ago: its backup is not the server's previous weight
            assert (bak - ref).abs().max() > 1e-3 and prev_server is not None and (bak - prev_server).abs().max() > 1e-3
        d = g + lam * g * g * (ref - bak)
        buf = d.clone() if buf is None else mom * buf + d
        prev_server = ref.clone()
        ref = ref - lr * buf
        backup[sender] = ref.clone()
        w.grad = g
        opt.set_sender(sender)
        opt.step()
        torch.testing.assert_close(w.detach(), ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(opt.backup(w, sender), ref, rtol=0, atol=1e-12)
    assert (backup["c"] - backup["a"]).abs().max() > 1e-3


def test_dcasgd_without_a_sender_uses_the_previous_weight_as_mxnet_does():
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    opt = DCASGD([w], lr=0.1, lamda=0.04)
    ref, prev = w.detach().clone(), w.detach().clone()
    for _ in range(4):
        g = torch.randn(10, dtype=torch.float64)
        new = ref - 0.1 * (g + 0.04 * g * g * (ref - prev))
        prev, ref = ref, new
        w.grad = g
        opt.step()
        torch.testing.assert_close(w.detach(), ref, rtol=0, atol=1e-12)


def test_dcasgd_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ConfigError, match="lamda"):
        DCASGD(p, lr=0.1, lamda=-1)
    with pytest.raises(ConfigError, match="momentum"):
        DCASGD(p, lr=0.1, momentum=1.0)


# tensor fusion ----------------------------------------------------------------------------------------------
def _tensors(*specs):
    return [torch.zeros(n, dtype=dtype) for n, dtype in specs]


def test_fusion_packs_small_tensors_of_one_dtype_in_order_and_lets_half_a_bucket_or_more_travel_alone():
    f32, f64 = torch.float32, torch.float64
    specs = [(100, f32), (50, f32), (1000, f32), (30, f64), (20, f32), (10, f64), (7, torch.int64), (200, f32),
             (10, f32), (100, f32)]
    tensors = _tensors(*specs)
    names = [f"t{i}" for i in range(len(tensors))]
    fusion = Fusion("x", names, tensors, bucket_bytes=1024)     # 256 float32 elements per bucket
    buckets = [(b.key, b.dtype, b.members, b.offsets, b.numel) for b in fusion.buckets]
    # t2 (4000 bytes), t7 (800, over half a bucket) and the integer t6 travel alone and leave the open bucket
    # open, so t8 after t7 still joins t0, t1, t4 (720 bytes together); t9 (400 more) would overflow it and opens
    # the next bucket, alone in it, so it travels alone too (400 bytes); the float64 t3 and t5 have their own bucket
    assert buckets == [("__geomx.fused/x/t0+4", f32, (0, 1, 4, 8), (0, 100, 150, 170), 180),
                       ("__geomx.fused/x/t3+2", f64, (3, 5), (0, 30), 40)]
    assert fusion.alone == [2, 6, 7, 9] and fusion.keys == 6
    # the plan depends only on names, shapes and dtypes: every worker plans the same buckets
    again = Fusion("x", names, _tensors(*specs), bucket_bytes=1024)
    assert again.buckets == fusion.buckets and again.alone == fusion.alone


def test_a_bucket_goes_at_the_priority_of_the_member_backward_makes_last_below_the_tensors_it_wraps_around():
    """FSA's order (geomx.sync.wire_order.backward_order): the bucket of t0, t1, t4, t8 fills when backward makes
    t0, after t2, t6 and t7, which travel alone; at its highest member's priority (t8's) it would overtake them."""
    from geomx.sync.wire_order import backward_order

    f32 = torch.float32
    specs = [(100, f32), (50, f32), (1000, f32), (30, f32), (20, f32), (10, f32), (7, torch.int64), (200, f32),
             (10, f32), (100, f32)]
    tensors = _tensors(*specs)
    fusion = Fusion("x", [f"t{i}" for i in range(10)], tensors, bucket_bytes=1024)
    priorities = backward_order(10)
    buckets = GradientBuckets(fusion, list(range(10)), priorities)

    class Recorder:
        def __init__(self) -> None:
            self.pushed: list[tuple[str, int]] = []

        def pushpull(self, key, value, out=None, priority=0):
            self.pushed.append((key, priority))
            return object()

    kv, handles = Recorder(), {}
    for i in reversed(range(10)):                 # backward makes the last tensors first
        if i in buckets.bucket_of:
            buckets.add(kv, i, tensors[i], handles)
    first_bucket = next(b for b in fusion.buckets if 0 in b.members)
    assert (first_bucket.key, priorities[0]) in kv.pushed
    assert priorities[0] < min(priorities[i] for i in fusion.alone)     # below every tensor sent alone before it


def test_fusion_of_zero_bytes_sends_every_tensor_alone(monkeypatch):
    tensors = _tensors((4, torch.float32), (4, torch.float32))
    assert Fusion("x", ["a", "b"], tensors, bucket_bytes=0).alone == [0, 1]
    monkeypatch.setenv("GEOMX_FUSION_BYTES", "0")
    assert Fusion("x", ["a", "b"], tensors).buckets == []
    monkeypatch.setenv("GEOMX_FUSION_BYTES", "4MiB")
    with pytest.raises(ConfigError, match=r"GEOMX_FUSION_BYTES='4MiB'.*whole number"):
        Fusion("x", ["a", "b"], tensors)


@pytest.mark.parametrize("compression, keys", [
    (None, ["__geomx.fused/x/t0+2", "t1"]),                    # t0 and t2 fused, the large t1 alone
    ({"lan": "fp16", "small": "fp16", "size_lower_bound": 10}, ["t0", "t1", "t2"]),   # not fused: each alone
])
def test_a_packed_round_sends_each_tensor_scaled_once_and_reads_sent_and_result_in_place(compression, keys):
    """PackedRound (HFA's overlapped DC averages): one message per bucket or tensor alone, the sent buffers hold
    the tensors times the scale, the result lands where result_views read it, and the next round reuses the
    same buffers."""
    from types import SimpleNamespace

    from geomx.compression import parse_policy
    from geomx.sync.fusion import PackedRound

    policy = parse_policy(compression).to_wire() if compression else None

    class SumOfTwo:         # the DC's sum of two workers that sent the same: twice what this one sent
        compression = policy

        def __init__(self):
            self.keys = []

        def pushpull(self, key, value, *, out, scope):
            assert scope == "dc"
            self.keys.append(key)
            torch.mul(value, 2.0, out=out)
            return SimpleNamespace(wait=lambda: None)

    tensors = [torch.arange(6.0).reshape(2, 3), torch.arange(300.0), torch.full((4,), -1.5)]
    packed = PackedRound(Fusion("x", ["t0", "t1", "t2"], tensors, bucket_bytes=1024), SumOfTwo(), tensors,
                         scope="dc")
    for scale in (0.25, 1.0):
        kv = SumOfTwo()
        for h in packed.pushpull(kv, tensors, scale=scale):
            h.wait()
        assert kv.keys == keys
        for t, sent, result in zip(tensors, packed.sent_views, packed.result_views, strict=True):
            assert sent.shape == t.shape and torch.equal(sent, t * scale) and torch.equal(result, 2 * t * scale)
    assert len(packed.sent) == len(keys)        # one buffer per message, the same ones for every round
    # a tensor alone travels in its own shape: its key was initialized so, and a codec may read the shape
    alone = [buf.shape for key, buf in zip(keys, packed.sent, strict=True) if key in ("t0", "t1", "t2")]
    assert alone == [t.shape for name, t in zip(["t0", "t1", "t2"], tensors, strict=True) if name in keys]


def test_buckets_of_a_round_that_crosses_the_wan_are_at_most_one_part(monkeypatch):
    from types import SimpleNamespace

    from geomx.sync.fusion import bucket_bytes_for

    over_wan = SimpleNamespace(cfg=SimpleNamespace(partition_bytes=256 << 10),
                               wire_part_bytes=lambda key, shape: 256 << 10)
    assert bucket_bytes_for(over_wan, crosses_wan=True) == 256 << 10
    assert bucket_bytes_for(over_wan, crosses_wan=False) == 4 << 20          # a DC-only round: the whole size
    unpartitioned = SimpleNamespace(cfg=SimpleNamespace(partition_bytes=0))
    assert bucket_bytes_for(unpartitioned, crosses_wan=True) == 4 << 20
    monkeypatch.setenv("GEOMX_FUSION_BYTES", "0")
    assert bucket_bytes_for(over_wan, crosses_wan=True) == 0 == bucket_bytes_for(over_wan, crosses_wan=False)


@pytest.mark.parametrize("compression, dc_fused, global_fused", [
    (None, True, True),
    ({"type": "fp16"}, True, True),
    ({"wan": {"type": "qsgd", "levels": 127, "bucket_size": 512}}, True, True),
    ({"lan": "bf16", "wan": {"type": "powersgd", "rank": 2}}, True, False),   # PowerSGD reads matrices
    ({"type": "bsc", "threshold": 0.01}, True, False),                       # a sparsifier's size bound
    ({"lan": "fp16", "wan": "qsgd", "small": "fp16", "size_lower_bound": 10}, False, False),
])
def test_rounds_travel_fused_only_where_every_codec_they_cross_reads_values_elementwise(
        compression, dc_fused, global_fused):
    """A codec for small tensors blocks fusion on both tiers: a bucket would take the tier's codec instead."""
    from types import SimpleNamespace

    from geomx.compression import parse_policy

    kv = SimpleNamespace(compression=parse_policy(compression).to_wire() if compression else None)
    assert (Fusion.fuses(kv, "dc"), Fusion.fuses(kv)) == (dc_fused, global_fused)


class _Reply:
    """A request handle whose reply arrives ``after_s`` after the wait begins (0: already in)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s

    def wait(self) -> None:
        if self.after_s:
            time.sleep(self.after_s)


def test_an_overlapped_average_counts_as_late_only_when_its_landing_had_to_wait_for_it(monkeypatch):
    from geomx.sync.averaging import HFA, InFlight, LandingWaits

    # a late threshold far above what a busy machine's scheduler can add to a wait that returns at once
    monkeypatch.setattr(LandingWaits, "LATE_S", 0.03)
    hfa = HFA(k1=1, k2=2, overlap=1)
    w = torch.nn.Parameter(torch.zeros(3))
    hfa.params, hfa.base, hfa.dc_scale, hfa.global_scale = [("w", w)], [torch.zeros(3)], 1.0, 1.0
    for after_s in (0.0, 0.1, 0.0):
        flight = InFlight([_Reply(after_s)], [torch.ones(3)])
        flight.sent = [w.detach().clone()]
        hfa.flights.append(flight)
        hfa.land(scheduled=True)
    last = InFlight([_Reply(0.1)], [torch.ones(3)])
    last.sent = [w.detach().clone()]
    hfa.flights.append(last)
    hfa.land()                                  # the run's end (finish): expected to wait, not counted
    waits = hfa.landing_waits
    assert (waits.landings, waits.late) == (3, 1)
    assert 0.1 <= waits.waited_s < 0.1 + 2 * waits.LATE_S + 0.5
    assert HFA(k1=1, k2=2).landing_waits is None            # without overlap every average is waited for
    restored = HFA(k1=1, k2=2, overlap=1)
    hfa.waits.global_landing = 0.25
    restored.load_state_dict(hfa.state_dict())
    assert restored.landing_waits == waits
    assert restored.wait_phases == hfa.wait_phases and restored.wait_phases["global_landing"] == 0.25


def test_several_averages_in_flight_are_saved_and_restored_in_order_and_land_alike():
    """D > K2 keeps two global averages travelling; a saved state holds both (waited for, not adopted), and the
    restored policy lands them as the original does. A state saved when one average at most travelled (a dict
    or None under "in_flight") still loads."""
    from geomx.sync.averaging import HFA, InFlight

    def policy() -> HFA:
        hfa = HFA(k1=1, k2=2, overlap=3, overlap_keep=0.5)
        w = torch.nn.Parameter(torch.arange(3.0))
        hfa.params, hfa.base, hfa.dc_scale, hfa.global_scale = [("w", w)], [torch.zeros(3)], 1.0, 1.0
        return hfa

    original = policy()
    for period, value in ((2, 1.0), (4, 5.0)):
        flight = InFlight([_Reply(0.0)], [torch.full((3,), value)])
        flight.sent, flight.period = [torch.full((3,), value / 2)], period
        original.flights.append(flight)
    restored = policy()
    restored.load_state_dict(original.state_dict())
    assert [f.period for f in restored.flights] == [2, 4]
    for hfa in (original, restored):
        hfa.land(scheduled=True)
        hfa.land(scheduled=True)
    assert torch.equal(original.params[0][1], restored.params[0][1])
    assert not torch.equal(original.params[0][1].detach(), torch.arange(3.0))
    older = original.state_dict()
    for saved, expected in ((None, []), ({**_flight_state(), "period": 6}, [6])):
        older["in_flight"] = saved
        again = policy()
        again.load_state_dict(older)
        assert [f.period for f in again.flights] == expected



def test_a_compressed_average_sent_as_a_scaled_change_is_saved_restored_and_lands_on_its_own_base():
    """A compressed global average travels as (model - base) x share, packed (``sent_relative``): landing keeps
    keep x (w - w_sent) on top of base + mean change, where w_sent = base + sent / share; a saved state lands the
    same, and a state saved before the change (the model sent whole) still loads as such."""
    from geomx.sync.averaging import HFA, InFlight

    base, w_sent, mean_change = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 2.0, 5.0]), torch.tensor(
        [0.5, -1.0, 1.0])

    def policy() -> HFA:
        hfa = HFA(k1=1, k2=2, overlap=1, overlap_keep=0.5)
        w = torch.nn.Parameter(torch.tensor([4.0, 0.0, 6.0]))      # moved on since the send
        hfa.params, hfa.base, hfa.dc_scale, hfa.global_scale = [("w", w)], [base.clone()], 1.0, 0.25
        return hfa

    original = policy()
    flight = InFlight([_Reply(0.0)], [mean_change.clone()], deltas=[mean_change.clone()], base=original.base)
    flight.sent, flight.sent_scale, flight.sent_relative = [(w_sent - base) * 0.25], 0.25, True
    flight.period = 1
    original.flights.append(flight)
    restored = policy()
    restored.load_state_dict(original.state_dict())
    assert restored.flights[0].sent_relative
    for hfa in (original, restored):
        hfa.land(scheduled=True)
    expected = base + mean_change + 0.5 * (torch.tensor([4.0, 0.0, 6.0]) - w_sent)
    for hfa in (original, restored):
        assert torch.allclose(hfa.params[0][1].detach(), expected)
        assert torch.allclose(hfa.base[0], base + mean_change)      # the next rounds' base: the new global model
    older = original.state_dict()
    older["in_flight"] = [{**_flight_state(), "period": 3}]
    del older["in_flight"][0]["sent_relative"]
    again = policy()
    again.load_state_dict(older)
    assert not again.flights[0].sent_relative

def test_a_dc_average_in_flight_is_saved_and_restored_and_lands_alike():
    """dc_overlap: a state saved between a DC average's send and its landing holds it with the step it left at;
    the restored policy adopts it as the original does (keeping the steps taken since the send); a state of
    2026-11-28 (its DC period in "dc_in_flight") loads with that period's step, and one saved before the option
    existed loads with none travelling."""
    from geomx.sync.averaging import HFA, InFlight

    def policy() -> HFA:
        hfa = HFA(k1=2, k2=3, dc_overlap=1)
        w = torch.nn.Parameter(torch.arange(3.0))
        hfa.params, hfa.base, hfa.dc_scale, hfa.global_scale = [("w", w)], [torch.zeros(3)], 1.0, 1.0
        return hfa

    original = policy()
    flight = InFlight([_Reply(0.0)], [torch.full((3,), 4.0)])
    flight.sent, flight.period = [torch.full((3,), 0.5)], 4     # left at step 4, packed as the model x 0.5
    flight.sent_scale = 0.5
    original.dc_flight = flight
    restored = policy()
    restored.load_state_dict(original.state_dict())
    assert restored.dc_flight is not None and restored.dc_flight.period == 4
    assert restored.dc_flight.sent_scale == 0.5
    for hfa in (original, restored):
        hfa.land_dc()
        assert hfa.dc_flight is None
    expected = torch.arange(3.0) + 4.0 - 1.0                # avg + (w - w_sent)
    assert torch.equal(original.params[0][1].detach(), expected)
    assert torch.equal(restored.params[0][1].detach(), expected)
    by_period = original.state_dict()
    by_period["dc_in_flight"] = {**_flight_state(), "period": 2}    # left at the 2nd DC boundary: step 2 x K1
    del by_period["dc_in_flight_step"]
    converted = policy()
    converted.load_state_dict(by_period)
    assert converted.dc_flight is not None and converted.dc_flight.period == 4
    older = original.state_dict()
    del older["dc_in_flight_step"]
    again = policy()
    again.load_state_dict(older)
    assert again.dc_flight is None


@pytest.mark.parametrize("saved,loaded,words", [
    # two averages in flight, saved under overlap 2: under overlap 0 they never reached a landing step and
    # finish() applied both, stale, at the end of the run
    ("HFA", dict(overlap=0), ["overlap (GEOMX_HFA_OVERLAP) 2 when saved, 0 here"]),
    ("HFA", dict(k1=2, k2=3, overlap=2), ["K1 (MXNET_KVSTORE_HFA_K1) 1 when saved, 2 here",
                                          "K2 (MXNET_KVSTORE_HFA_K2) 1 when saved, 3 here"]),
    ("HFA", dict(weights="equal"), ["weights (GEOMX_HFA_WEIGHTS) 'samples' when saved, 'equal' here"]),
    ("DiLoCo", dict(outer_lr=0.3), ["outer_lr (GEOMX_DILOCO_LR) 0.7 when saved, 0.3 here"]),
    ("DiLoCo", dict(outer_momentum=0.0), ["outer_momentum (GEOMX_DILOCO_MOMENTUM) 0.9 when saved, 0.0 here"]),
])
def test_averaging_state_loads_only_under_the_options_it_was_saved_with_naming_each_change(saved, loaded, words):
    import geomx.sync

    policy = getattr(geomx.sync, saved)
    state = policy(k1=1, k2=1, overlap=2).state_dict()
    with pytest.raises(ConfigError) as err:
        policy(**{"overlap": 2, **loaded}).load_state_dict(state)
    for w in [f"saved {policy.name} state", *words, "resume with the options of the run that saved it"]:
        assert w in str(err.value), str(err.value)
    same = policy(k1=1, k2=1, overlap=2, overlap_keep=0.5)      # keep applies at landing: not the state's
    same.load_state_dict(state)
    del state["options"]                                         # saved before the options were: loads as it is
    policy(overlap=0).load_state_dict(state)


def _flight_state() -> dict:
    from geomx.sync.averaging import InFlight

    flight = InFlight([], [torch.ones(3)])
    flight.sent = [torch.zeros(3)]
    return flight.state_dict()


def test_a_lan_only_key_travels_in_lan_sized_parts_and_is_refused_in_rounds_that_cross_the_wan():
    """init(lan_only=True) (tensor fusion's DC-only buckets): with the WAN's parts 1 KiB, a 4 KiB key is cut in
    4 parts, the same key initialized for DC-only rounds travels whole; its DC rounds sum the DC's workers, and a
    round that would cross the WAN is refused naming the key."""
    import numpy as np

    from geomx.errors import KVError
    from inproc import DEADLINE_S, HipsCluster

    cluster = HipsCluster(dcs=("a", "b"), per_dc=2)
    try:
        kvs = [kv for workers in cluster.workers.values() for kv in workers]
        for kv in (cluster.master, *kvs):
            kv.cfg.partition_bytes = 1024          # what GEOMX_PARTITION_BYTES would give every process
        value = np.arange(1024, dtype=np.float32)
        for key, lan_only in (("wan-key", False), ("lan-key", True)):
            cluster.master.init(key, value, lan_only=lan_only)
            for kv in kvs:
                kv.init(key, np.zeros_like(value), lan_only=lan_only)
        a0 = cluster.workers["a"][0]
        assert len(a0._layout["wan-key"][2]) == 4 and a0._layout["lan-key"][2] is None     # the parts planned
        rounds = [kv.pushpull("lan-key", value * (i + 1), scope="dc") for i, kv in enumerate(kvs)]
        sums = [h.wait(DEADLINE_S) for h in rounds]
        np.testing.assert_array_equal(sums[0], value * 3)       # DC a: workers 1 and 2
        np.testing.assert_array_equal(sums[3], value * 7)       # DC b: workers 3 and 4
        for op in (lambda: a0.pushpull("lan-key", value), lambda: a0.push("lan-key", value),
                   lambda: a0.pull("lan-key")):
            with pytest.raises(KVError, match=r"key 'lan-key' was initialized for DC-only rounds"):
                op()
    finally:
        cluster.close()
