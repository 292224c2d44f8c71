"""Partitions of the emulated WAN that heal: ``geomx launch --inject partition:DC@T+D`` cuts every link to and from
DC for D seconds, T seconds after the deployment started (geomx.cli.inject). The launcher hands them to the
emulator in ``GEOMX_WAN_OUTAGES``, a JSON object {DC: [[start_s, end_s], ...]} on the emulator's clock (it starts
first, with the launcher); each link applies the outages of its two ends (geomx.netem.link).
"""
from __future__ import annotations

import json
import math

from geomx.errors import ConfigError

ENV = "GEOMX_WAN_OUTAGES"

Outages = dict[str, list[tuple[float, float]]]


def to_env(outages: Outages) -> str:
    return json.dumps({dc: [[start, end] for start, end in spans] for dc, spans in outages.items()})


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
            pairs = [(float(start), float(end)) for start, end in spans]
        except (TypeError, ValueError):
            raise ConfigError(f"{ENV}: DC {dc!r} needs a list of [start_s, end_s] pairs, got {spans!r}") from None
        for start, end in pairs:
            if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
                raise ConfigError(f"{ENV}: DC {dc!r} has an outage {start:g}-{end:g} s; it must start at >= 0 s "
                                  f"and end after it starts")
        out[dc] = pairs
    return out


def for_link(outages: Outages, src_dc: str, dst_dc: str) -> list[tuple[float, float]]:
    """The outages of a link: those of either of its ends."""
    return [*outages.get(src_dc, []), *outages.get(dst_dc, [])]
