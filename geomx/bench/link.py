"""Benchmark of one emulated WAN link: does it deliver the configured rate and the configured delay?

An in-process :class:`~geomx.netem.WanEmulator` and two vans (DC ``a`` and the ``central`` party) exchange
real :class:`~geomx.transport.message.Message` objects over 127.0.0.1:

1. goodput: for each message size, ``a`` sends about ``seconds`` worth of data at the configured rate;
   goodput = wire bytes (header + tensor) / (last arrival - first send), as a fraction of the configured rate.
   That figure includes one one-way delay; ``steady`` leaves it out: bytes after the first message /
   (last arrival - first arrival).
2. added one-way delay: the median RTT of small ping-pongs through the emulator minus the median RTT of the
   same ping-pongs sent directly (interleaved, so both see the same machine load), divided by 2.

With ``tcp`` (loss, streams, window: geomx.netem.tcp_model) the link's rate is what that many TCP streams move
over its RTT; goodput is then reported against that model as well as against the line rate.

Every figure is measured in the run; the configured numbers are returned next to them.
"""
from __future__ import annotations

import math
import statistics
import threading
import time

import numpy as np

from geomx.errors import DeadlineError
from geomx.netem.emulator import WanEmulator
from geomx.netem.tcp_model import TcpPath
from geomx.profiles import CENTRAL_DC, custom_profile
from geomx.transport.message import Message, encode, payload_nbytes
from geomx.transport.van import ZmqVan

KIB = 1024
MIB = 1024 * 1024


class _Inbox:
    """Records (arrival time, message) for a van and lets the bench wait for a count, with a deadline."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, Message]] = []
        self._cv = threading.Condition()

    def __call__(self, msg: Message) -> None:
        t = time.monotonic()
        with self._cv:
            self.arrivals.append((t, msg))
            self._cv.notify_all()

    def wait_for(self, count: int, timeout: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: len(self.arrivals) >= count, timeout):
                raise DeadlineError(f"link bench: {len(self.arrivals)} of {count} messages arrived in {timeout:.1f} s")

    def clear(self) -> None:
        with self._cv:
            self.arrivals.clear()


def bench_link(*, rate_bps: float = 100e6, rtt_s: float = 0.040, jitter_s: float = 0.0,
               sizes: tuple[int, ...] = (64 * KIB, 1 * MIB, 4 * MIB), seconds: float = 1.5, pings: int = 40,
               ping_bytes: int = 64, timeout_s: float = 30.0, tcp: TcpPath | None = None) -> dict:
    """Measure goodput per message size and the added one-way delay; see the module docstring."""
    profile = custom_profile(rate_bps, rtt_s, jitter_s)
    tcp = tcp or TcpPath()
    model_bps = tcp.goodput_bps(rate_bps, rtt_s)      # what the link should deliver
    emulator = WanEmulator(profile=profile, tcp=tcp)
    emulator.start()
    inbox_a, inbox_c = _Inbox(), _Inbox()
    # a van routes through the emulator only when a send names dst_dc, so one pair measures both paths
    van_a = ZmqVan(node_id="bench-a", dc="a", on_message=inbox_a, emulator=emulator.address)
    holder: dict[str, ZmqVan] = {}

    def central_handler(msg: Message) -> None:
        if msg.op == "ping":    # answer on the same path the ping took
            holder["c"].send(msg["reply_to"], Message("pong", fields={"id": msg["id"]}),
                             dst_dc="a" if msg["via"] else None)
        else:
            inbox_c(msg)

    van_c = ZmqVan(node_id="bench-c", dc=CENTRAL_DC, on_message=central_handler, emulator=emulator.address)
    holder["c"] = van_c
    try:
        van_a.start()
        van_c.start()
        # connect every socket on the path first, so that connection set-up is not counted as link time
        van_a.send(van_c.address, Message("warm-up"), dst_dc=CENTRAL_DC)
        inbox_c.wait_for(1, timeout_s)
        transfers = [_transfer(van_a, van_c, inbox_c, emulator, model_bps, size, seconds, timeout_s)
                     for size in sizes]
        rtt_direct, rtt_emulated = _pings(van_a, van_c, inbox_a, pings, ping_bytes, rtt_s, timeout_s)
    finally:
        van_a.stop()
        van_c.stop()
        emulator.stop()
    added = (statistics.median(rtt_emulated) - statistics.median(rtt_direct)) / 2
    return {"rate_bps": model_bps, "line_rate_bps": rate_bps, "loss": tcp.loss, "streams": tcp.streams,
            "window_bytes": tcp.window_bytes, "rtt_s": rtt_s, "one_way_delay_s": profile.one_way_delay_s,
            "jitter_s": jitter_s,
            "chunk_bytes": emulator.chunk_bytes, "transfers": transfers, "pings": pings,
            "rtt_direct_median_s": statistics.median(rtt_direct),
            "rtt_emulated_median_s": statistics.median(rtt_emulated),
            "added_one_way_delay_s": added, "delay_error_s": added - profile.one_way_delay_s}


def _transfer(van_a: ZmqVan, van_c: ZmqVan, inbox: _Inbox, emulator: WanEmulator, rate_bps: float, size: int,
              seconds: float, timeout_s: float) -> dict:
    count = max(2, math.ceil(rate_bps * seconds / 8 / size))
    tensor = np.zeros(size, dtype=np.uint8)
    wire = [payload_nbytes(encode(Message("bulk", src=van_a.node_id, fields={"i": i}, tensors=[tensor])))
            for i in range(count)]
    before = emulator.link("a", CENTRAL_DC).snapshot()["bytes"]
    inbox.clear()
    first_send = time.monotonic()
    for i in range(count):
        van_a.send(van_c.address, Message("bulk", fields={"i": i}, tensors=[tensor]), dst_dc=CENTRAL_DC)
    inbox.wait_for(count, timeout_s + 2 * seconds)
    times = [t for t, _ in inbox.arrivals]
    total = sum(wire)
    goodput = total * 8 / (times[-1] - first_send)
    steady = (total - wire[0]) * 8 / (times[-1] - times[0])
    return {"message_bytes": size, "messages": count, "bytes": total, "seconds": times[-1] - first_send,
            "goodput_bps": goodput, "goodput_fraction": goodput / rate_bps,
            "steady_bps": steady, "steady_fraction": steady / rate_bps,
            "emulator_bytes": emulator.link("a", CENTRAL_DC).snapshot()["bytes"] - before}


def _pings(van_a: ZmqVan, van_c: ZmqVan, inbox: _Inbox, pings: int, ping_bytes: int, rtt_s: float,
           timeout_s: float) -> tuple[list[float], list[float]]:
    payload = np.zeros(ping_bytes, dtype=np.uint8)
    rtts: dict[bool, list[float]] = {False: [], True: []}
    inbox.clear()
    n = 0
    for _i in range(pings):
        for via in (False, True):   # interleaved: both paths see the same load
            t0 = time.monotonic()
            van_a.send(van_c.address, Message("ping", fields={"id": n, "via": via, "reply_to": van_a.address},
                                              tensors=[payload]), dst_dc=CENTRAL_DC if via else None)
            n += 1
            inbox.wait_for(n, timeout_s + rtt_s)
            rtts[via].append(inbox.arrivals[-1][0] - t0)
    return rtts[False], rtts[True]


def format_link_report(result: dict) -> str:
    """A markdown report of :func:`bench_link`'s result."""
    rate, line = result["rate_bps"], result["line_rate_bps"]
    tcp = ""
    if result["loss"] or result["window_bytes"] is not None:
        window = f", window {result['window_bytes']:,} B" if result["window_bytes"] is not None else ""
        tcp = (f", loss {result['loss']:.4%}, {result['streams']} TCP stream(s){window}: the model gives "
               f"{rate / 1e6:.3g} Mbit/s ({rate / line:.1%} of the line)")
    lines = [f"### WAN link: {line / 1e6:g} Mbit/s, RTT {result['rtt_s'] * 1000:g} ms "
             f"(one-way {result['one_way_delay_s'] * 1000:g} ms), chunk {result['chunk_bytes'] // KIB} KiB{tcp}",
             "",
             "| message size | messages | MB sent | time (s) | goodput (Mbit/s) | of rate "
             "| steady (Mbit/s) | of rate |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in result["transfers"]:
        lines.append(f"| {_size(t['message_bytes'])} | {t['messages']} | {t['bytes'] / 1e6:.2f} | {t['seconds']:.3f} "
                     f"| {t['goodput_bps'] / 1e6:.2f} | {t['goodput_fraction']:.1%} "
                     f"| {t['steady_bps'] / 1e6:.2f} | {t['steady_fraction']:.1%} |")
    lines += ["",
              "| one-way delay | configured (ms) | measured (ms) | error (ms) |",
              "|---|---:|---:|---:|",
              f"| median of {result['pings']} ping-pongs | {result['one_way_delay_s'] * 1000:.2f} "
              f"| {result['added_one_way_delay_s'] * 1000:.2f} | {result['delay_error_s'] * 1000:+.2f} |",
              "",
              f"Median RTT direct {result['rtt_direct_median_s'] * 1000:.3f} ms, through the emulator "
              f"{result['rtt_emulated_median_s'] * 1000:.3f} ms. Goodput = wire bytes / (last arrival - first send), "
              f"one one-way delay included; steady leaves it out. \"Of rate\": of the link's modelled rate "
              f"({rate / 1e6:.3g} Mbit/s)."]
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // KIB} KiB" if n % KIB == 0 else f"{n} B"


if __name__ == "__main__":
    print(format_link_report(bench_link()))
