"""The text form of lines of their own (a node's, a DC's) in an emulator variable: ``NAME=RATE,...``."""
from __future__ import annotations

from collections.abc import Callable

from geomx.errors import ConfigError
from geomx.profiles import parse_rate


def parse_rated(text: str | None, var: str, form: str, name_ok: Callable[[str], bool]) -> dict[str, float]:
    """``"NAME=RATE,..."`` -> {NAME: bit/s}; an entry whose name fails ``name_ok``, or whose rate is not a rate
    > 0, is refused naming ``var``, the entry and ``form`` (what an entry should look like)."""
    rates: dict[str, float] = {}
    for entry in (text or "").replace(" ", "").split(","):
        if not entry:
            continue
        name, sep, rate_text = entry.rpartition("=")
        if not sep or not name or not rate_text or not name_ok(name):
            raise ConfigError(f"{var}: entry {entry!r} is not {form}")
        try:
            rate = parse_rate(rate_text)
        except ConfigError as exc:
            raise ConfigError(f"{var}: entry {entry!r}: {exc}") from None
        if not rate > 0:
            raise ConfigError(f"{var}: entry {entry!r}: the rate must be > 0")
        rates[name] = rate
    return rates


def rated_env(rates: dict[str, float]) -> str:
    """The inverse of :func:`parse_rated`, every digit kept."""
    return ",".join(f"{name}={rate!r}bit" for name, rate in sorted(rates.items()))
