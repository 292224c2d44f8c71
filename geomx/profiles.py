"""WAN emulation profiles: defined once, used by the launcher, the benchmarks and the docs.

Rates are bits per second of the emulated link, one link per directed DC pair. ``rtt_s`` is the round-trip
time; each direction adds ``rtt_s / 2`` of one-way delay. ``uplink_bps``/``downlink_bps`` differ only for
asymmetric profiles (``volunteer``): "up" is DC -> central party, "down" is central party -> DC.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from geomx.errors import ConfigError


@dataclass(frozen=True)
class WanProfile:
    name: str
    uplink_bps: float | None      # None = not emulated (direct loopback)
    downlink_bps: float | None
    rtt_s: float
    jitter_s: float = 0.0
    description: str = ""
    # the packet loss such a path typically sees (shared/reference/anchors_wan.md's profiles); the emulator applies
    # it only when asked (--wan-loss profile), since it caps each TCP stream (geomx.netem.tcp_model)
    loss: float = 0.0

    @property
    def emulated(self) -> bool:
        return self.uplink_bps is not None

    @property
    def one_way_delay_s(self) -> float:
        return self.rtt_s / 2.0

    def rate_for(self, src_dc: str, dst_dc: str) -> float:
        """Rate of the directed link src_dc -> dst_dc (the central party is named ``central``)."""
        if self.uplink_bps is None:
            raise ConfigError(f"profile {self.name!r} is not emulated")
        return self.downlink_bps if src_dc == CENTRAL_DC else self.uplink_bps


CENTRAL_DC = "central"

MBIT = 1e6
GBIT = 1e9

PROFILES: dict[str, WanProfile] = {
    p.name: p
    for p in (
        WanProfile("lan", None, None, 0.0, description="no emulation: every link is the machine's loopback"),
        WanProfile("regional", 1 * GBIT, 1 * GBIT, 0.020, 0.0005, "1 Gbit/s, 20 ms RTT (Dublin-Frankfurt)"),
        WanProfile("transatlantic", 300 * MBIT, 300 * MBIT, 0.080, 0.002, "300 Mbit/s, 80 ms RTT", loss=1e-4),
        WanProfile("transpacific", 100 * MBIT, 100 * MBIT, 0.180, 0.005, "100 Mbit/s, 180 ms RTT", loss=5e-4),
        WanProfile("volunteer", 50 * MBIT, 250 * MBIT, 0.080, 0.005,
                   "50 Mbit/s up (DC to central), 250 Mbit/s down, 80 ms RTT", loss=1e-3),
    )
}


def get_profile(name: str) -> WanProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown WAN profile {name!r}; known profiles: {', '.join(PROFILES)}") from None


def custom_profile(rate_bps: float, rtt_s: float, jitter_s: float = 0.0) -> WanProfile:
    """A symmetric profile from explicit numbers (``--wan-rate`` / ``--wan-rtt``)."""
    # `not x > 0` rather than `x <= 0`: NaN passes the latter, and a NaN rate hung the emulator
    if not (math.isfinite(rate_bps) and rate_bps > 0):
        raise ConfigError(f"WAN rate must be a finite number > 0 bit/s, got {rate_bps}")
    if not (math.isfinite(rtt_s) and rtt_s >= 0 and math.isfinite(jitter_s) and jitter_s >= 0):
        raise ConfigError(f"WAN RTT and jitter must be finite numbers >= 0, got rtt={rtt_s} jitter={jitter_s}")
    return WanProfile("custom", rate_bps, rate_bps, rtt_s, jitter_s,
                      f"{rate_bps / MBIT:g} Mbit/s, {rtt_s * 1000:g} ms RTT")


# a capital B is bytes ("100MB/s", "100MBps"); rates here are bits per second, and reading megabytes as megabits
# ran the link 8 times too slow without a word
_BYTE_RATE = re.compile(r"(?P<number>.*?)\s*(?P<prefix>[kKmMgG]?)B(?:ps|/s)?")
# below this a rate is surely a missing unit (--wan-rate 100 is 100 bit/s: the run crawls), never a WAN
MIN_RATE_BPS = 1e3


def parse_rate(text: str) -> float:
    """'100mbit', '1gbit', '500kbit', '100Mbps', '1e8' (bit/s) -> bits per second, at least 1 kbit/s. Byte units
    (a capital B: '100MB/s') are refused, naming the rate in bits."""
    byte = _BYTE_RATE.fullmatch(text.strip())
    if byte:
        try:
            bits = float(byte["number"]) * 8 * {"": 1.0, "k": 1e3, "m": MBIT, "g": GBIT}[byte["prefix"].lower()]
            instead = f"write {_in_bits(bits)}" if math.isfinite(bits) and bits > 0 else "write e.g. 100mbit"
        except ValueError:
            instead = "write e.g. 100mbit"
        raise ConfigError(f"rate {text!r} is in bytes per second (a capital B), but rates are in bits per second: "
                          f"{instead}")
    t = text.strip().lower().replace("/s", "").replace("bps", "bit")
    for suffix, mult in (("gbit", GBIT), ("mbit", MBIT), ("kbit", 1e3), ("bit", 1.0), ("g", GBIT), ("m", MBIT),
                         ("k", 1e3)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], mult
            break
    else:
        scale = 1.0
    try:
        rate = float(t) * scale
    except ValueError:
        raise ConfigError(f"cannot read a rate from {text!r}; write e.g. 100mbit or 1gbit") from None
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate {text!r} must be a finite number > 0, e.g. 100mbit")
    if rate < MIN_RATE_BPS:
        raise ConfigError(f"rate {text!r} is {rate:g} bit/s, below 1 kbit/s: surely a unit slip (a bare number "
                          f"is bit/s); give the unit, e.g. 100mbit")
    return rate


def _in_bits(bps: float) -> str:
    """1e8 -> '100mbit'."""
    for unit, scale in (("gbit", GBIT), ("mbit", MBIT), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def parse_duration(text: str) -> float:
    """'80ms', '0.08s', '80' (milliseconds) -> seconds: a finite number >= 0."""
    t = text.strip().lower()
    try:
        if t.endswith("ms"):
            seconds = float(t[:-2]) / 1000.0
        elif t.endswith("s"):
            seconds = float(t[:-1])
        else:
            seconds = float(t) / 1000.0
    except ValueError:
        raise ConfigError(f"cannot read a duration from {text!r}; write e.g. 80ms") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"duration {text!r} must be a finite number >= 0, e.g. 80ms")
    return seconds
