"""The text form of lines of their own (a node's, a DC's) in an emulator variable: ``NAME=RATE,...``."""
from __future__ import annotations

from collections.abc import Callable

from geomx.errors import ConfigError
from geomx.profiles import parse_rate


def parse_rated(text: str | None, var: str, form: str, name_ok: Callable[[str], bool], *,
                two_way: bool = False) -> dict:
    """``"NAME=RATE,..."`` -> {NAME: bit/s}; an entry whose name fails ``name_ok``, or whose rate parse_rate
    refuses, is refused naming ``var``, the entry and ``form`` (what an entry should look like). ``two_way``:
    ``NAME=UP[/DOWN]`` -> {NAME: (up, down)}, down as fast as up where not given."""
    rates: dict = {}
    for entry in (text or "").replace(" ", "").split(","):
        if not entry:
            continue
        name, sep, rate_text = entry.rpartition("=")
        if not sep or not name or not rate_text or not name_ok(name):
            raise ConfigError(f"{var}: entry {entry!r} is not {form}")
        texts = rate_text.split("/") if two_way else [rate_text]
        if len(texts) > 2:
            raise ConfigError(f"{var}: entry {entry!r} is not {form}")
        both = []
        for part in texts:
            try:
                rate = parse_rate(part)
            except ConfigError as exc:     # not a finite number > 0, or not a rate
                raise ConfigError(f"{var}: entry {entry!r}: {exc}") from None
            both.append(rate)
        rates[name] = (both[0], both[-1]) if two_way else both[0]
    return rates


def rated_env(rates: dict) -> str:
    """The inverse of :func:`parse_rated`, every digit kept (``(up, down)`` pairs as ``UP/DOWN``)."""
    def text(rate) -> str:
        return "/".join(f"{r!r}bit" for r in rate) if isinstance(rate, tuple) else f"{rate!r}bit"

    return ",".join(f"{name}={text(rate)}" for name, rate in sorted(rates.items()))
