"""Outages of the emulated WAN that end: ``geomx launch --inject partition:DC@T+D`` cuts every link to and from
DC for D seconds, T seconds after the deployment started, and ``slow:DC@T+D=RATE`` leaves those links RATE
(geomx.cli.inject). The launcher hands them to the emulator in ``GEOMX_WAN_OUTAGES``, a JSON object
{DC: [[start_s, end_s], [start_s, end_s, rate_bps], ...]} on the emulator's clock (it starts first, with the
launcher); each link applies the outages of its two ends (geomx.netem.link).
"""
from __future__ import annotations

import json
import math

from geomx.errors import ConfigError

ENV = "GEOMX_WAN_OUTAGES"

Outages = dict[str, list[tuple]]     # DC -> [(start_s, end_s) cut, or (start_s, end_s, rate_bps) slowed]


def to_env(outages: Outages) -> str:
    return json.dumps({dc: [list(span) for span in spans] for dc, spans in outages.items()})


def from_env(text: str | None, dcs) -> Outages:
    """Parse ``GEOMX_WAN_OUTAGES``; every error names the variable and what is wrong in it."""
    if not text:
        return {}
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{ENV} is not JSON ({exc}): {text[:200]!r}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{ENV} must be a JSON object {{DC: [[start_s, end_s], ...]}}, got {text[:200]!r}")
    known = set(dcs) if dcs is not None else None
    out: Outages = {}
    for dc, spans in raw.items():
        if known is not None and dc not in known:
            raise ConfigError(f"{ENV} names DC {dc!r}, which is not in this deployment ({', '.join(sorted(known))})")
        try:
            entries = [tuple(float(x) for x in span) for span in spans]
        except (TypeError, ValueError):
            entries = None
        if entries is None or any(len(e) not in (2, 3) for e in entries):
            raise ConfigError(f"{ENV}: DC {dc!r} needs a list of [start_s, end_s] or [start_s, end_s, rate_bps], "
                              f"got {spans!r}")
        for entry in entries:
            wrong = problem(entry)
            if wrong:
                raise ConfigError(f"{ENV}: DC {dc!r} has an outage {list(entry)}: {wrong}")
        out[dc] = entries
    return out


def problem(entry: tuple) -> str | None:
    """What is wrong with one outage (start_s, end_s[, rate_bps]), or None: the rule both the variable's parser and
    a link built by hand (geomx.netem.link) apply."""
    start, end, *kept = entry
    if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
        return "it must start at >= 0 s and end after it starts"
    if kept and not (math.isfinite(kept[0]) and kept[0] > 0):
        return "a rate kept must be > 0 (leave it out to cut the links)"
    return None


def for_link(outages: Outages, src_dc: str, dst_dc: str) -> list[tuple]:
    """The outages of a link: those of either of its ends."""
    return [*outages.get(src_dc, []), *outages.get(dst_dc, [])]
