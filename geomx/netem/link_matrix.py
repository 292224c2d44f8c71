"""Per-link WAN settings: a DC near the central party and one far away, on one emulator (issue 15).

The profile gives every link the same rate and RTT (up and down may differ). Overrides name links:

* ``SRC->DST=RATE/RTT``: one directed link, e.g. ``b->central=50mbit/250ms``;
* ``DC=RATE/RTT``: both directions between a DC and the central party, e.g. ``b=50mbit/250ms``;
* either with its own packet loss and/or jitter after more slashes, told apart by their units (a jitter is a
  duration with its unit, a loss a percentage or a fraction): ``b=50mbit/250ms/0.1%``, ``b=50mbit/250ms/5ms``,
  ``b=50mbit/250ms/0.1%/5ms`` (else the deployment's loss and the profile's jitter).

From flags (``geomx launch --wan-link b=50mbit/250ms``, repeatable), a topology file
(``wan_links = {b = "50mbit/250ms", "a->central" = "1gbit/20ms"}``), or the emulator's environment
(``GEOMX_WAN_LINKS``, written by the launcher with explicit units: ``b->central=50000000.0bit/0.25s,...``). Units
are those of the flags: a bare rate is bit/s, a bare RTT milliseconds, a loss a fraction or a percentage, a jitter
carries its unit; in ``GEOMX_WAN_LINKS`` the RTT must carry its unit too (a bare ``GEOMX_WAN_RTT`` is seconds). A
link given twice (``b=...`` and ``b->central=...`` both name b->central) is refused, naming both entries. Streams
and window are the deployment's, for every link, and so is the loss of a link that names none
(geomx.netem.tcp_model); the jitter of one that names none is the profile's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from geomx.errors import ConfigError
from geomx.netem.tcp_model import TcpPath, parse_loss
from geomx.profiles import CENTRAL_DC, parse_duration, parse_rate

ENV = "GEOMX_WAN_LINKS"


@dataclass(frozen=True)
class LinkSpec:
    rate_bps: float
    rtt_s: float
    loss: float | None = None       # None: the deployment's (--wan-loss)
    jitter_s: float | None = None   # None: the profile's

    def tcp(self, deployment: TcpPath) -> TcpPath:
        """The TCP path of this link: the deployment's, with this link's own loss where it has one."""
        return deployment if self.loss is None else replace(deployment, loss=self.loss)


def parse_link_overrides(entries, dcs: list[str], where: str = "", what: str = "WAN link",
                         bare_rtt_ms: bool = True) -> dict[tuple[str, str], LinkSpec]:
    """``["b=50mbit/250ms", "a->central=1gbit/20ms"]`` (or a table of them) -> {(src, dst): LinkSpec};
    ``dcs``: the deployment's DCs, the central party not included; ``what``: the flag or key errors name;
    ``bare_rtt_ms``: a bare RTT is milliseconds (as --wan-rtt), else refused (the emulator's variable, among
    variables whose bare durations are seconds)."""
    entries = assignments(entries, "wan_links", "LINK=RATE/RTT", where)
    known = [*dcs, CENTRAL_DC]
    out: dict[tuple[str, str], LinkSpec] = {}
    given: dict[tuple[str, str], str] = {}      # link -> the entry that set it
    for entry in entries:
        text = str(entry).strip()
        link, sep, value = text.partition("=")
        rate_text, slash, rest = value.partition("/")
        rtt_text, *extra = rest.split("/")
        if not sep or not slash or not link or len(extra) > 2:
            raise ConfigError(f"{what} {text!r}{where}: write SRC->DST=RATE/RTT[/LOSS][/JITTER] or "
                              f"DC=RATE/RTT[/LOSS][/JITTER], e.g. b=50mbit/250ms or b=50mbit/250ms/0.1%/5ms")
        src, arrow, dst = link.partition("->")
        pairs = [(src, dst)] if arrow else [(link, CENTRAL_DC), (CENTRAL_DC, link)]
        for a, b in pairs:
            if a not in known or b not in known:
                raise ConfigError(f"{what} {text!r}{where}: link {a}->{b} names a DC outside this deployment "
                                  f"({', '.join(known)})")
            if a == b:
                raise ConfigError(f"{what} {text!r}{where}: link {a}->{b} joins a DC to itself")
            if (a, b) in given:     # one of them would be dropped without a word
                raise ConfigError(f"{what}{where}: link {a}->{b} is given twice, by {given[(a, b)]!r} and by "
                                  f"{text!r}; give each link once")
            given[(a, b)] = text
        if not bare_rtt_ms and not _has_time_unit(rtt_text):
            raise ConfigError(f"{what} {text!r}{where}: its RTT {rtt_text!r} needs its unit (ms or s)")
        try:        # the units of every other WAN setting: a bare rate is bit/s, a bare RTT milliseconds
            spec = LinkSpec(parse_rate(rate_text), parse_duration(rtt_text), **_loss_and_jitter(extra))
        except ConfigError as exc:
            raise ConfigError(f"{what} {text!r}{where}: {exc}") from None
        if spec.loss is not None and not 0.0 <= spec.loss < 1.0:
            raise ConfigError(f"{what} {text!r}{where}: loss must be a fraction in [0, 1), got {spec.loss!r}")
        out.update({pair: spec for pair in pairs})
    return out


def _loss_and_jitter(fields: list[str]) -> dict:
    """The optional fields after RTT, told apart by their units: a jitter ends in a time unit (5ms, 0.005s),
    anything else is a loss (0.1%, 0.001)."""
    out: dict = {}
    for text in fields:
        kind = "jitter_s" if _has_time_unit(text) else "loss"
        if kind in out:
            raise ConfigError(f"two {'jitters' if kind == 'jitter_s' else 'losses'} ({text!r} the second); a jitter "
                              f"needs its unit (ms or s)")
        out[kind] = parse_duration(text) if kind == "jitter_s" else parse_loss(text, "its loss")
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


def to_env(overrides: dict[tuple[str, str], LinkSpec]) -> str:
    """Units written out and every digit kept (repr), so that :func:`from_env` reads back the very numbers."""
    return ",".join(f"{a}->{b}={s.rate_bps!r}bit/{s.rtt_s!r}s" + (f"/{s.loss!r}" if s.loss is not None else "")
                    + (f"/{s.jitter_s!r}s" if s.jitter_s is not None else "")
                    for (a, b), s in sorted(overrides.items()))


def describe(overrides: dict[tuple[str, str], LinkSpec]) -> str:
    """For people: ``b->central 50 Mbit/s, 250 ms RTT, loss 0.1%; ...``."""
    def one(spec: LinkSpec) -> str:
        rate = (f"{spec.rate_bps / 1e9:.4g} Gbit/s" if spec.rate_bps >= 1e9 else f"{spec.rate_bps / 1e6:.4g} Mbit/s")
        return ", ".join([rate, f"{spec.rtt_s * 1e3:.4g} ms RTT",
                          *([f"loss {spec.loss * 100:.4g}%"] if spec.loss is not None else []),
                          *([f"jitter {spec.jitter_s * 1e3:.4g} ms"] if spec.jitter_s is not None else [])])
    return "; ".join(f"{a}->{b} {one(s)}" for (a, b), s in sorted(overrides.items()))


def from_env(text: str | None, dcs: list[str] | None) -> dict[tuple[str, str], LinkSpec]:
    """The emulator's side of :func:`to_env`; ``dcs``: its configured DCs (central included), if known."""
    if not text:
        return {}
    names = [d for d in (dcs or _named(text)) if d != CENTRAL_DC]
    try:
        return parse_link_overrides(text.split(","), names, bare_rtt_ms=False)
    except ConfigError as exc:
        raise ConfigError(f"{ENV}: {exc}") from None


def _named(text: str) -> list[str]:
    return sorted({dc for entry in text.split(",") for dc in entry.partition("=")[0].split("->")})


def _has_time_unit(text: str) -> bool:
    """``5ms``, ``0.005s``: a number with a time unit (``lots`` is not)."""
    t = text.strip().lower()
    number = t[:-2] if t.endswith("ms") else t[:-1] if t.endswith("s") else None
    if number is None:
        return False
    try:
        float(number)
    except ValueError:
        return False
    return True
