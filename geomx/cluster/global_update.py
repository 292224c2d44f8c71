"""How a global server turns the gradients it receives into the value its clients read.

Chosen once per server from the kvstore mode and whether the master worker installed an optimizer:

============  =====================  ==================================================================
mode          server optimizer       value a client reads after pushing
============  =====================  ==================================================================
dist_sync     yes                    weights after one optimizer step on the round's reduced gradient
dist_sync     no                     the round's reduced gradient over all workers of all DCs
dist_async    yes                    weights right after this DC's gradient was applied (MixedSync)
dist_async    no                     every gradient applied since this client's last read, reduced
                                     (MixedSync overlap: every *other* DC's, its own it had at once)
============  =====================  ==================================================================

"Reduced" is the master worker's reduction (config.REDUCTIONS): the **sum** of the pushes, as MXNet's and
GeoMX's servers give it (a ported script's learning rate is calibrated to it: ``trainer.step(num_all_workers *
batch_size)``), or the **mean** over the training workers world-wide, which DistributedOptimizer asks for: a
round of FSA then equals one step of single-process training on the union of all workers' batches. The
policies divide by ``divisor`` (1 for the sum). In dist_async each DC's push is applied alone, scaled by the
same divisor, so one push from every DC moves the model as far as one synchronous round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from geomx.cluster.kvserver import KeyState, Refused

OPTIMIZER_MODULES = ("torch.optim", "geomx.optim")


class UpdatePolicy:
    """Per key, a policy keeps its memory in ``st.update`` (a dataclass with state_dict / load_state_dict),
    created by :meth:`init_key` once the key has its value."""
    synchronous = True

    def __init__(self, divisor: int) -> None:
        self.divisor = float(divisor)       # the training workers world-wide for the mean, 1 for the sum

    def init_key(self, st: KeyState) -> None:
        """Set ``st.update`` (the key's memory) when the policy needs one."""

    def apply(self, server, st: KeyState, total: np.ndarray, contributors: list[str]) -> None:
        raise NotImplementedError

    def read(self, st: KeyState, src: str) -> np.ndarray:
        return st.value


class RoundGradient(UpdatePolicy):
    """The round's gradient, reduced, is the value clients read."""
    def apply(self, server, st, total, contributors):
        if self.divisor == 1.0:     # the sum (or a single worker's mean): the round's total as it is
            mean = total
        elif total.flags.writeable:   # the round's own sum: divide in place, no extra pass
            mean = np.divide(total, self.divisor, out=total)
        else:
            mean = total / self.divisor
        server.set_value(st, mean.astype(st.dtype, copy=False), contributors)


@dataclass
class RelayState:
    """A relay's gradients applied but not yet read, per client (summed; divided when read)."""
    pending: dict[str, np.ndarray] | None = None

    def state_dict(self) -> dict:
        return {"pending": None if self.pending is None else dict(self.pending)}

    def load_state_dict(self, state: dict) -> None:
        pending = state["pending"]
        self.pending = None if pending is None else {c: np.array(a) for c, a in pending.items()}


class GradientRelay(UpdatePolicy):
    """Asynchronous worker-side updates: nothing is lost, each DC receives every gradient exactly once.
    ``echo_own=False`` (MixedSync overlap): a DC's own pushes are not sent back to it, its local server already
    gave them to its workers."""
    synchronous = False

    def __init__(self, divisor: int, clients: list[str], *, echo_own: bool = True) -> None:
        super().__init__(divisor)
        self.clients, self.echo_own = clients, echo_own

    def init_key(self, st):
        st.update = RelayState()

    def apply(self, server, st, total, contributors):
        relay = st.update
        if relay.pending is None:
            relay.pending = {c: np.zeros_like(total) for c in self.clients}
        pending = relay.pending
        for client, acc in pending.items():
            if self.echo_own or client not in contributors:
                acc += total
        server.set_value(st, st.value, contributors)

    def read(self, st, src):
        pending = st.update.pending
        if pending is None or st.pushes.get(src, 0) == 0:
            return st.value
        out = (pending[src] / self.divisor).astype(st.dtype)
        pending[src][...] = 0
        return out


def _tensors_to_arrays(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _tensors_to_arrays(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors_to_arrays(v) for v in obj)
    return obj


def _arrays_to_tensors(obj: Any) -> Any:
    """The inverse for an optimizer's state_dict: every array in it was a tensor (torch keeps no arrays)."""
    import torch

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj))
    if isinstance(obj, dict):
        return {k: _arrays_to_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_arrays_to_tensors(v) for v in obj)
    return obj


@dataclass
class OptimizerState:
    """A server optimizer's parameter (fp32 for 16-bit keys: more precise than the value clients read) and
    the torch optimizer stepping it."""
    param: Any       # torch.nn.Parameter
    optimizer: Any   # torch.optim.Optimizer
    updates: int = 0    # steps taken: where a learning-rate schedule is (geomx.optim.schedules)

    def state_dict(self) -> dict:
        return {"param": self.param.detach().numpy().copy(),
                "optimizer": _tensors_to_arrays(self.optimizer.state_dict()), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        import torch

        param = np.asarray(state["param"])
        if param.shape != tuple(self.param.shape) or param.dtype != self.param.detach().numpy().dtype:
            raise ValueError(f"saved parameter has shape {param.shape} {param.dtype}, the key's optimizer "
                             f"{tuple(self.param.shape)} {self.param.dtype}")
        with torch.no_grad():
            self.param.copy_(torch.from_numpy(param))
        self.optimizer.load_state_dict(_arrays_to_tensors(state["optimizer"]))
        self.updates = int(state.get("updates", 0))     # saved before schedules: none ran, none to go on with


class ServerOptimizer(UpdatePolicy):
    """A torch.optim optimizer per key, stepping on the round's reduced gradient (sync) or each DC's share
    (async)."""

    def __init__(self, divisor: int, optimizer_class, kwargs: dict, synchronous: bool, lr_schedule=None) -> None:
        super().__init__(divisor)
        self.optimizer_class, self.kwargs, self.synchronous = optimizer_class, kwargs, synchronous
        self.lr_schedule = lr_schedule      # geomx.optim.schedules, or None: the rate set up stays

    def init_key(self, st):
        import torch

        if not np.issubdtype(st.dtype, np.floating):
            raise Refused(f"key {st.key!r} is {st.dtype.name}: a server optimizer needs floating-point values")
        param = torch.nn.Parameter(torch.from_numpy(st.value.astype(np.float32 if st.dtype != np.float64
                                                                     else np.float64)))
        optimizer = self.optimizer_class([param], **self.kwargs)
        if self.lr_schedule is not None:
            if any("lr" not in group for group in optimizer.param_groups):
                raise Refused(f"lr_schedule {self.lr_schedule.name!r}: optimizer {self.optimizer_class.__name__} "
                              f"has no learning rate ('lr') to scale")
            for group in optimizer.param_groups:    # the rate a schedule scales (a LambdaLR's base_lrs)
                group.setdefault("initial_lr", group["lr"])
        st.update = OptimizerState(param, optimizer)

    def apply(self, server, st, total, contributors):
        import torch

        param, opt = st.update.param, st.update.optimizer
        if hasattr(opt, "set_sender"):
            # optimizers that compensate delays (geomx.optim.DCASGD) keep a weight backup per sender; the clients
            # of a synchronous round all read the same weights, so they count as one sender, "*"
            opt.set_sender("*" if self.synchronous else contributors[0])
        param.grad = torch.from_numpy((total / self.divisor).astype(param.detach().numpy().dtype))
        if self.lr_schedule is not None:
            factor = self.lr_schedule.factor(st.update.updates)
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * factor
        opt.step()
        st.update.updates += 1
        server.set_value(st, param.detach().numpy().astype(st.dtype, copy=True), contributors)


def resolve_optimizer(name: str, kwargs: dict, extra_modules: tuple[str, ...] = ()):
    """'torch.optim.SGD' or 'SGD' -> the class, after checking it accepts ``kwargs``. Only optimizer modules
    are searched: a configuration message must never import arbitrary code. ``extra_modules``: the user's own
    optimizer modules that the server's operator allowed (GEOMX_OPTIMIZER_MODULES on the global servers)."""
    import importlib

    import torch

    allowed = (*OPTIMIZER_MODULES, *extra_modules)
    module_name, _, cls_name = name.rpartition(".")
    modules = [module_name] if module_name else list(OPTIMIZER_MODULES)
    for mod in modules:
        if mod not in allowed:
            raise Refused(f"optimizer {name!r} is not from {' or '.join(allowed)} (a module of your own: list it "
                          f"in GEOMX_OPTIMIZER_MODULES on the global servers)")
        cls = getattr(importlib.import_module(mod), cls_name, None)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            break
    else:
        raise Refused(f"unknown optimizer {name!r}: not a torch.optim.Optimizer in {', '.join(modules)}")
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except Exception as exc:
        raise Refused(f"optimizer {name} rejected its arguments {kwargs}: {exc}") from None
    return cls
