"""The learning-rate schedules the global servers run with their optimizer (geomx.optim.schedules): their
formulas against torch's own schedulers, their specs refused naming the field, and a key's update count saved
with its optimizer state so that a resumed run goes on with the schedule where it was."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import geomx
from geomx.cluster.global_update import ServerOptimizer
from geomx.errors import ConfigError
from geomx.optim.schedules import StepDecay, WarmupCosine, parse_schedule


def _torch_rates(schedule_of, steps: int) -> list[float]:
    """The rates torch's scheduler gives an optimizer of rate 1.0 at steps 0..steps-1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = schedule_of(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


def test_step_decay_gives_the_rates_of_torchs_steplr():
    ours = [StepDecay(step_size=3, gamma=0.5).factor(u) for u in range(10)]
    theirs = _torch_rates(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 10)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_warmup_cosine_warms_up_linearly_then_decays_to_its_floor():
    s = WarmupCosine(warmup=4, total=14, min_ratio=0.1)
    assert [s.factor(u) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.factor(14) == pytest.approx(0.1) and s.factor(100) == pytest.approx(0.1)
    theirs = _torch_rates(lambda o: torch.optim.lr_scheduler.LambdaLR(o, s.factor), 20)
    np.testing.assert_allclose([s.factor(u) for u in range(20)], theirs, rtol=1e-12)


@pytest.mark.parametrize("spec, named", [
    ({"name": "cosine"}, "name 'cosine' is not one of warmup_cosine, step"),
    ({"name": "step"}, "missing 1 required positional argument: 'step_size'"),
    ({"name": "step", "step_size": 0}, "step_size=0 must be an integer >= 1"),
    ({"name": "step", "step_size": 2.5}, "step_size=2.5 must be an integer"),
    ({"name": "warmup_cosine", "warmup": 2, "total": 10, "min_ratio": 1.5}, "min_ratio=1.5 must be a number"),
    ({"name": "warmup_cosine", "warmup": 2, "total": 10, "floor": 0.1}, "unexpected keyword argument 'floor'"),
    ("warmup_cosine", "or its spec (a dict with 'name'), not str"),
    ({"name": "warmup_cosine", "warmup": 10, "total": 5}, "warmup=10 is longer than total=5"),
])
def test_a_bad_schedule_spec_is_refused_naming_the_field(spec, named):
    with pytest.raises(ConfigError, match="lr_schedule") as refused:
        parse_schedule(spec)
    assert named in str(refused.value), refused.value


def test_a_spec_round_trips_and_the_schedules_are_public():
    s = geomx.WarmupCosine(warmup=5, total=50, min_ratio=0.1)
    assert parse_schedule(s.to_spec()) == s and parse_schedule(s) is s and parse_schedule(None) is None
    assert parse_schedule(geomx.StepDecay(step_size=2).to_spec()) == StepDecay(step_size=2, gamma=0.1)
    # numpy's scalars are numbers, as the codecs' options take them
    from_numpy = parse_schedule({"name": "step", "step_size": np.int64(3), "gamma": np.float32(0.5)})
    assert from_numpy.factor(3) == 0.5 and type(from_numpy.to_spec()["step_size"]) is int


def test_a_keys_update_count_is_saved_with_its_optimizer_so_a_resumed_schedule_goes_on():
    """A server optimizer with a halving rate steps a key 3 times; its state loaded into a fresh policy (a resumed
    global server) steps on at the 4th rate, not the 1st."""
    from types import SimpleNamespace

    class Server:
        def set_value(self, st, value, contributors):
            st.value = value

    def key():
        return SimpleNamespace(key="w", dtype=np.dtype(np.float32), value=np.zeros(1, np.float32), update=None)

    policy = ServerOptimizer(1, torch.optim.SGD, {"lr": 1.0}, True, lr_schedule=StepDecay(step_size=1, gamma=0.5))
    st = key()
    policy.init_key(st)
    for _ in range(3):
        policy.apply(Server(), st, np.ones(1, np.float32), ["a"])
    assert st.value.tolist() == [-1.75] and st.update.updates == 3
    resumed = key()
    policy.init_key(resumed)
    resumed.update.load_state_dict(st.update.state_dict())
    policy.apply(Server(), resumed, np.ones(1, np.float32), ["a"])
    assert resumed.value.tolist() == [-1.875]          # -1.75 - 0.125, the 4th update's rate


def test_a_server_schedule_without_the_servers_optimizer_is_refused():
    from geomx.torch import DistributedOptimizer

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="server_lr_schedule is the global servers' schedule, for "
                                          "update_on_server=True"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                             server_lr_schedule=StepDecay(step_size=1))
