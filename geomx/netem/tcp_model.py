"""How fast TCP can move a link's traffic: the ceiling the emulator puts on a link's rate (issue 15).

A real WAN path is slower than its line rate for two reasons that matter to geo-distributed training:

* **The window.** A stream has at most ``window`` bytes unacknowledged, so it moves at most ``window / RTT``:
  Linux's default receive buffer (about 6 MiB) caps one stream at 280 Mbit/s over a 180 ms RTT.
* **Loss.** Congestion control halves the window at each loss; on average a stream then moves about
  ``MSS * sqrt(3/2) / (RTT * sqrt(p))`` (Mathis et al., 1997, "The macroscopic behavior of the TCP congestion
  avoidance algorithm"): 0.01% loss over 80 ms leaves one stream 17 Mbit/s.

Both are per stream, so ``streams`` parallel connections move ``streams`` times as much, up to the line rate:
why systems that cross WANs open many connections. The emulator applies the ceiling as the link's rate
(goodput).

* **Slow start after idle** (``slow_start``): Linux's default (``net.ipv4.tcp_slow_start_after_idle = 1``)
  sends a connection that was idle for longer than its retransmission timeout (RTT + 200 ms, the kernel's
  ``tcp_rto_min``) back to its initial window of 10 segments (RFC 6928), from which the window doubles every
  RTT. A training step that computes for longer than that starts every push in slow start: one stream over
  180 ms needs 1.3 s to climb from 0.64 Mbit/s to 100 Mbit/s, eight streams 0.8 s. Modelled as a fluid: the
  line's rate is ``streams * 10 * MSS / RTT * 2^(t / RTT)`` until it reaches the goodput above.

Not modelled: the sawtooth of congestion avoidance (loss is its mean rate), retransmitted bytes on the line,
and packet reordering.

Configured per deployment by ``GEOMX_WAN_LOSS`` (a fraction, or a percentage such as ``0.01%``),
``GEOMX_WAN_STREAMS``, ``GEOMX_WAN_WINDOW`` (bytes per stream) and ``GEOMX_WAN_SLOW_START`` (1), or ``geomx
launch --wan-loss/--wan-streams/--wan-window/--wan-slow-start``. Unset, a link runs at its line rate, as before.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from geomx.errors import ConfigError

MSS_BYTES = 1448            # a 1500-byte MTU less IPv4, TCP and timestamp headers
MATHIS_C = math.sqrt(1.5)   # periodic loss, one ack per segment
INITIAL_WINDOW_SEGMENTS = 10    # RFC 6928, Linux's default
RTO_MIN_S = 0.2             # Linux's tcp_rto_min: the retransmission timeout is about RTT + this
ENV_LOSS, ENV_STREAMS, ENV_WINDOW = "GEOMX_WAN_LOSS", "GEOMX_WAN_STREAMS", "GEOMX_WAN_WINDOW"
ENV_SLOW_START = "GEOMX_WAN_SLOW_START"


@dataclass(frozen=True)
class TcpPath:
    """What the TCP streams of every emulated link see; the defaults leave a link at its line rate."""
    loss: float = 0.0                   # probability that a packet is lost
    streams: int = 1                    # parallel connections sharing the link's traffic
    window_bytes: int | None = None     # per-stream window (None: not the limit)
    slow_start: bool = False            # back to the initial windows after an idle retransmission timeout

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ConfigError(problem)

    def problem(self) -> str | None:
        if not (isinstance(self.loss, (int, float)) and 0.0 <= self.loss < 1.0):
            return f"WAN loss must be a fraction in [0, 1) ({ENV_LOSS}, --wan-loss), got {self.loss!r}"
        if isinstance(self.streams, bool) or not isinstance(self.streams, int) or self.streams < 1:
            return f"WAN streams must be a whole number >= 1 ({ENV_STREAMS}, --wan-streams), got {self.streams!r}"
        if self.window_bytes is not None and (isinstance(self.window_bytes, bool) or not isinstance(
                self.window_bytes, int) or self.window_bytes < MSS_BYTES):
            return (f"WAN window must be a whole number of bytes >= {MSS_BYTES} ({ENV_WINDOW}, --wan-window), got "
                    f"{self.window_bytes!r}")
        return None

    @property
    def limits(self) -> bool:
        """Whether this path can hold a link below its line rate."""
        return self.loss > 0 or self.window_bytes is not None or self.slow_start

    def stream_bps(self, rtt_s: float) -> float:
        """One stream's ceiling over ``rtt_s`` (inf where nothing limits it)."""
        if rtt_s <= 0:
            return math.inf
        ceiling = math.inf
        if self.window_bytes is not None:
            ceiling = self.window_bytes * 8 / rtt_s
        if self.loss > 0:
            ceiling = min(ceiling, MSS_BYTES * 8 * MATHIS_C / (rtt_s * math.sqrt(self.loss)))
        return ceiling

    def goodput_bps(self, line_bps: float, rtt_s: float) -> float:
        """What the link delivers: its line rate, or the streams' ceiling where that is lower."""
        return min(line_bps, self.streams * self.stream_bps(rtt_s))

    @staticmethod
    def retransmit_timeout_s(rtt_s: float) -> float:
        return rtt_s + RTO_MIN_S

    def initial_bps(self, rtt_s: float) -> float:
        """What the streams' initial windows move per second over ``rtt_s``."""
        return self.streams * INITIAL_WINDOW_SEGMENTS * MSS_BYTES * 8 / rtt_s

    def slow_start_elapsed(self, since_s: float, bits: float, rate_bps: float, rtt_s: float) -> float:
        """Slow start began ``since_s`` before ``bits`` start on a line whose rate the windows grow to is
        ``rate_bps``: how long after slow start began the bits have left (the fluid model above)."""
        r0 = self.initial_bps(rtt_s)
        if r0 >= rate_bps:
            return since_s + bits / rate_bps
        grown_at = rtt_s * math.log2(rate_bps / r0)         # when the doubling windows reach the rate
        if since_s >= grown_at:
            return since_s + bits / rate_bps
        per_doubling = rtt_s / math.log(2)
        room = (rate_bps - r0 * 2 ** (since_s / rtt_s)) * per_doubling    # bits the rest of slow start carries
        if bits <= room:
            return rtt_s * math.log2(2 ** (since_s / rtt_s) + bits / (r0 * per_doubling))
        return grown_at + (bits - room) / rate_bps

    def to_env(self) -> dict[str, str]:
        env = {}
        if self.loss:
            env[ENV_LOSS] = repr(self.loss)
        if self.streams != 1:
            env[ENV_STREAMS] = str(self.streams)
        if self.window_bytes is not None:
            env[ENV_WINDOW] = str(self.window_bytes)
        if self.slow_start:
            env[ENV_SLOW_START] = "1"
        return env


def parse_loss(text, what: str = ENV_LOSS) -> float:
    """``0.0001`` or ``0.01%`` -> 0.0001."""
    raw = str(text).strip()
    try:
        return float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ConfigError(f"{what}={raw!r} is not a loss fraction (0.0001) or percentage (0.01%)") from None


def _whole(text, what: str) -> int:
    raw = str(text).strip()
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{what}={raw!r} is not a whole number") from None


def _switch(value, what: str) -> bool:
    if isinstance(value, bool):
        return value
    raw = str(value).strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{what}={value!r} is not 1 or 0 (true or false)")


ENV_NAMES = {"streams": ENV_STREAMS, "window": ENV_WINDOW, "slow_start": ENV_SLOW_START}


def tcp_path(*, loss=None, streams=None, window=None, slow_start=None, where: str = "",
             names: dict[str, str] | None = None) -> TcpPath:
    """A TcpPath from flags, TOML values or variables (None: the default); errors name the setting: its
    variable, or ``names[setting]`` (the TOML key and flag the value came from)."""
    named = {**ENV_NAMES, **(names or {})}
    try:
        return TcpPath(loss=parse_loss(loss) if loss is not None else 0.0,
                       streams=_whole(streams, named["streams"]) if streams is not None else 1,
                       window_bytes=_whole(window, named["window"]) if window is not None else None,
                       slow_start=_switch(slow_start, named["slow_start"]) if slow_start is not None else False)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{where}") from None


def tcp_path_from_env(env: Mapping[str, str]) -> TcpPath:
    return tcp_path(loss=env.get(ENV_LOSS) or None, streams=env.get(ENV_STREAMS) or None,
                    window=env.get(ENV_WINDOW) or None, slow_start=env.get(ENV_SLOW_START) or None)
