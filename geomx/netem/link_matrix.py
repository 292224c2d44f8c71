"""Per-link WAN settings: a DC near the central party and one far away, on one emulator (issue 15).

The profile gives every link the same rate and RTT (up and down may differ). Overrides name links:

* ``SRC->DST=RATE/RTT``: one directed link, e.g. ``b->central=50mbit/250ms``;
* ``DC=RATE/RTT``: both directions between a DC and the central party, e.g. ``b=50mbit/250ms``.

From flags (``geomx launch --wan-link b=50mbit/250ms``, repeatable), a topology file
(``wan_links = {b = "50mbit/250ms", "a->central" = "1gbit/20ms"}``), or the emulator's environment
(``GEOMX_WAN_LINKS``, written by the launcher in plain numbers: ``b->central=5e+07/0.25,...``). A later entry for
the same link wins. Jitter stays the profile's. Not modelled yet: loss and TCP's window per stream.
"""
from __future__ import annotations

from dataclasses import dataclass

from geomx.errors import ConfigError
from geomx.profiles import CENTRAL_DC, parse_duration, parse_rate

ENV = "GEOMX_WAN_LINKS"


@dataclass(frozen=True)
class LinkSpec:
    rate_bps: float
    rtt_s: float


def parse_link_overrides(entries, dcs: list[str], where: str = "") -> dict[tuple[str, str], LinkSpec]:
    """``["b=50mbit/250ms", "a->central=1gbit/20ms"]`` (or a table of them) -> {(src, dst): LinkSpec};
    ``dcs``: the deployment's DCs, the central party not included."""
    entries = assignments(entries, "wan_links", "LINK=RATE/RTT", where)
    known = [*dcs, CENTRAL_DC]
    out: dict[tuple[str, str], LinkSpec] = {}
    for entry in entries:
        text = str(entry).strip()
        link, sep, value = text.partition("=")
        rate_text, slash, rtt_text = value.partition("/")
        if not sep or not slash or not link:
            raise ConfigError(f"WAN link {text!r}{where}: write SRC->DST=RATE/RTT or DC=RATE/RTT, e.g. "
                              f"b=50mbit/250ms")
        src, arrow, dst = link.partition("->")
        pairs = [(src, dst)] if arrow else [(link, CENTRAL_DC), (CENTRAL_DC, link)]
        for a, b in pairs:
            if a not in known or b not in known:
                raise ConfigError(f"WAN link {text!r}{where}: link {a}->{b} names a DC outside this deployment "
                                  f"({', '.join(known)})")
            if a == b:
                raise ConfigError(f"WAN link {text!r}{where}: link {a}->{b} joins a DC to itself")
        spec = LinkSpec(_number(rate_text, parse_rate, text, "rate", where),
                        _number(rtt_text, parse_duration, text, "RTT", where))
        if spec.rate_bps <= 0 or spec.rtt_s < 0:
            raise ConfigError(f"WAN link {text!r}{where}: rate must be > 0 and RTT >= 0")
        out.update({pair: spec for pair in pairs})
    return out


def assignments(entries, what: str, form: str, where: str = "") -> list[str]:
    """A setting given as a list of ``NAME=VALUE`` strings or as a table (TOML) -> the list; None -> []."""
    if entries is None:
        return []
    if isinstance(entries, dict):
        entries = [f"{k}={v}" for k, v in entries.items()]
    if isinstance(entries, str) or not isinstance(entries, list):
        raise ConfigError(f"{what}{where} must be a list of {form} strings, got {entries!r}")
    return [str(e) for e in entries]


def _number(text: str, parse_with_unit, entry: str, what: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_with_unit(text)
    except ConfigError:
        raise ConfigError(f"WAN link {entry!r}{where}: cannot read a {what} from {text!r}") from None


def to_env(overrides: dict[tuple[str, str], LinkSpec]) -> str:
    return ",".join(f"{a}->{b}={s.rate_bps:g}/{s.rtt_s:g}" for (a, b), s in sorted(overrides.items()))


def from_env(text: str | None, dcs: list[str] | None) -> dict[tuple[str, str], LinkSpec]:
    """The emulator's side of :func:`to_env`; ``dcs``: its configured DCs (central included), if known."""
    if not text:
        return {}
    names = [d for d in (dcs or _named(text)) if d != CENTRAL_DC]
    try:
        return parse_link_overrides(text.split(","), names)
    except ConfigError as exc:
        raise ConfigError(f"{ENV}: {exc}") from None


def _named(text: str) -> list[str]:
    return sorted({dc for entry in text.split(",") for dc in entry.partition("=")[0].split("->")})
