"""Codecs by name: ``@register("topk")`` on a codec class, ``make_codec({"type": "topk", "ratio": 0.001})``.

``make_codec`` accepts a name (``"fp16"``) or a dict with a ``"type"`` key and the codec's parameters. Every
mistake is a :class:`~geomx.errors.ConfigError` that names the parameter and the value: an unknown type lists
the known ones, an unknown parameter lists the accepted ones, an out-of-range value says the range. The
``check_*`` helpers below are what the codecs' ``__post_init__`` use for that.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import fields
from typing import TypeVar
from collections.abc import Callable

from geomx.errors import ConfigError

CODECS: dict[str, type] = {}

C = TypeVar("C", bound=type)


def register(name: str) -> Callable[[C], C]:
    """Class decorator: make the codec class available to :func:`make_codec` as ``name``."""
    def deco(cls: C) -> C:
        if name in CODECS:
            raise ValueError(f"codec {name!r} is registered twice ({CODECS[name].__name__}, {cls.__name__})")
        cls.name = name
        CODECS[name] = cls
        return cls
    return deco


def make_codec(spec: dict | str):
    """A codec from ``"name"`` or ``{"type": name, **params}``; see the module docstring."""
    _load_builtin()
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict) or "type" not in spec:
        raise ConfigError(f"a codec is a name or a dict with a 'type' key, got {spec!r}")
    params = dict(spec)
    kind = params.pop("type")
    cls = CODECS.get(str(kind).lower()) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"unknown codec type {kind!r}; known types: {', '.join(sorted(CODECS))}")
    accepted = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ConfigError(f"{cls.name} codec: unknown parameter(s) {', '.join(map(repr, unknown))}; accepted: "
                          f"{', '.join(sorted(accepted)) or 'none'}")
    return cls(**params)


def _load_builtin() -> None:
    from geomx.compression import codecs  # noqa: F401  (registers the built-in family on import)


# -- parameter checks (used by the codecs' __post_init__) ---------------------------------------------------------

def _normalized(codec, param: str, value):
    """Store the plain Python value (numpy scalars would not survive msgpack in ``spec()``)."""
    object.__setattr__(codec, param, value)     # the codecs are frozen dataclasses
    return value


def _bad(codec, param: str, value, need: str) -> ConfigError:
    return ConfigError(f"{codec.name} codec: {param} must be {need}, got {value!r}")


def check_number(codec, param: str, *, low: float, high: float = math.inf, open_low: bool = False,
                 open_high: bool = True) -> float:
    """A real number in the range; the check's message spells the range, e.g. ``in (0, 1)``."""
    value = getattr(codec, param)
    need = f"a number in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _bad(codec, param, value, need)
    if value < low or (open_low and value == low) or value > high or (open_high and value == high):
        raise _bad(codec, param, value, need)
    return _normalized(codec, param, float(value))


def check_fraction(codec, param: str) -> float:
    """A ratio of elements kept: strictly between 0 and 1."""
    return check_number(codec, param, low=0.0, high=1.0, open_low=True, open_high=True)


def check_int(codec, param: str, *, low: int, high: int | None = None) -> int:
    value = getattr(codec, param)
    need = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or \
            (high is not None and value > high):
        raise _bad(codec, param, value, need)
    return _normalized(codec, param, int(value))


def check_bool(codec, param: str) -> bool:
    value = getattr(codec, param)
    if not isinstance(value, bool):
        raise _bad(codec, param, value, "true or false")
    return value
