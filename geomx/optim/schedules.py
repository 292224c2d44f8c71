"""Learning-rate schedules the global servers run with their optimizer (``kv.set_optimizer(...,
lr_schedule=...)``, ``DistributedOptimizer(..., server_lr_schedule=...)``).

With the optimizer on the servers (GeoMX's update on the kvstore) a scheduler on the workers changes nothing:
the servers step with the rate they were given at set-up. MXNet's optimizers carried their scheduler to the
servers, which evaluated it at each key's update count; these do the same. A schedule is a registered policy
object, plain data on the wire (``to_spec()``: its name and numbers), and gives the factor on the optimizer's
own rate for a key's ``update``-th step (0 for the first), as ``torch.optim.lr_scheduler.LambdaLR`` does on a
worker that calls ``scheduler.step()`` after each ``optimizer.step()``. Each key counts its own updates (saved
with its optimizer state, so a resumed run goes on where it was); in ``dist_async`` each DC's update counts.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import ClassVar, Protocol

from geomx.errors import ConfigError


class LRSchedule(Protocol):
    name: ClassVar[str]

    def factor(self, update: int) -> float:
        """The factor on the optimizer's rate for a key's ``update``-th step (0-based)."""
        ...

    def to_spec(self) -> dict: ...


class _Spec:
    """What a schedule is on the wire: its registered name and its numbers."""
    name: ClassVar[str]

    def to_spec(self) -> dict:
        return {"name": self.name, **asdict(self)}


@dataclass(frozen=True)
class WarmupCosine(_Spec):
    """Linear warm-up to the full rate over ``warmup`` updates, then cosine decay to ``min_ratio`` of it at
    ``total`` (and flat after)."""
    warmup: int
    total: int
    min_ratio: float = 0.0
    name: ClassVar[str] = "warmup_cosine"

    def __post_init__(self) -> None:
        _check(self, "warmup", self.warmup, int, minimum=0)
        _check(self, "total", self.total, int, minimum=1)
        _check(self, "min_ratio", self.min_ratio, float, minimum=0.0, maximum=1.0)
        if self.warmup > self.total:    # the rate would fall from its peak straight to the floor
            raise ConfigError(f"lr_schedule {self.name!r}: warmup={self.warmup} is longer than total={self.total} "
                              f"(the decay ends at total)")

    def factor(self, update: int) -> float:
        if update < self.warmup:
            return (update + 1) / self.warmup
        progress = min(1.0, (update - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class StepDecay(_Spec):
    """The rate times ``gamma`` every ``step_size`` updates (``torch.optim.lr_scheduler.StepLR``)."""
    step_size: int
    gamma: float = 0.1
    name: ClassVar[str] = "step"

    def __post_init__(self) -> None:
        _check(self, "step_size", self.step_size, int, minimum=1)
        _check(self, "gamma", self.gamma, float, minimum=0.0)

    def factor(self, update: int) -> float:
        return self.gamma ** (update // self.step_size)


SCHEDULES: dict[str, type] = {cls.name: cls for cls in (WarmupCosine, StepDecay)}


def parse_schedule(spec) -> LRSchedule | None:
    """A schedule object, or its spec (``{"name": "warmup_cosine", "warmup": 10, "total": 300}``), or None.
    A ConfigError names the schedule and the field that is wrong."""
    if spec is None or isinstance(spec, tuple(SCHEDULES.values())):
        return spec
    if not isinstance(spec, dict):
        raise ConfigError(f"lr_schedule must be one of geomx.optim's schedules ({', '.join(SCHEDULES)}) or its "
                          f"spec (a dict with 'name'), not {type(spec).__name__}")
    fields = dict(spec)
    name = fields.pop("name", None)
    cls = SCHEDULES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"lr_schedule name {name!r} is not one of {', '.join(SCHEDULES)}")
    try:
        return cls(**fields)
    except TypeError as exc:        # a field it does not take, or one it needs missing
        raise ConfigError(f"lr_schedule {name!r}: {exc}".replace(f"{cls.__name__}.__init__() ", "")) from None


def _check(schedule, field: str, value, kind: type, *, minimum, maximum=None) -> None:
    # numpy's scalars count as numbers (np.int64(3) is an integer), as the codecs' options take them
    number = isinstance(value, numbers.Real) and not isinstance(value, bool) and (
        kind is float or isinstance(value, numbers.Integral))
    if not number or not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise ConfigError(f"lr_schedule {schedule.name!r}: {field}={value!r} must be "
                          f"{'an integer' if kind is int else 'a number'} {bounds}")
    # plain Python numbers: the spec crosses the wire as msgpack, which takes no numpy scalar
    object.__setattr__(schedule, field, int(value) if kind is int else float(value))
