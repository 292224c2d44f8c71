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

:func:`bench_capacity` measures the emulator itself: an emulator process started as deployments start it
(``python -m geomx.netem``) with a link too fast to matter (100 Gbit/s, no delay) forwards a stream of messages
between two vans of this process (64 in flight, as a sender's window); it reports the rate it forwarded and its
own CPU seconds per MB (user + system, read from ``/proc`` before and after).

Every figure is measured in the run; the configured numbers are returned next to them.
"""
from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from geomx.errors import DeadlineError
from geomx.netem.emulator import WanEmulator
from geomx.netem.tcp_model import TcpPath
from geomx.profiles import CENTRAL_DC, custom_profile
from geomx.transport.message import Message, encode, payload_nbytes
from geomx.transport.park_channel import wait_for_channel
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
        transfers = []
        for size in sizes:
            time.sleep(tcp.retransmit_timeout_s(rtt_s) if tcp.slow_start else 0.0)   # each from idle
            transfers.append(_transfer(van_a, van_c, inbox_c, emulator, model_bps, size, seconds, timeout_s))
            transfers[-1]["model_s"] = profile.one_way_delay_s + (
                tcp.slow_start_elapsed(0.0, transfers[-1]["bytes"] * 8, model_bps, rtt_s) if tcp.slow_start
                else transfers[-1]["bytes"] * 8 / model_bps)
        rtt_direct, rtt_emulated = _pings(van_a, van_c, inbox_a, pings, ping_bytes, rtt_s, timeout_s)
        chunk_bytes = emulator.link("a", CENTRAL_DC).chunk_bytes     # the floor, or more on a fast line
    finally:
        van_a.stop()
        van_c.stop()
        emulator.stop()
    added = (statistics.median(rtt_emulated) - statistics.median(rtt_direct)) / 2
    return {"rate_bps": model_bps, "line_rate_bps": rate_bps, "loss": tcp.loss, "streams": tcp.streams,
            "window_bytes": tcp.window_bytes, "slow_start": tcp.slow_start, "rtt_s": rtt_s,
            "one_way_delay_s": profile.one_way_delay_s, "jitter_s": jitter_s,
            "chunk_bytes": chunk_bytes, "transfers": transfers, "pings": pings,
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


def process_cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CAPACITY_MODES = ("relayed", "parked")


def start_emulator(env: dict[str, str], emulator_path: str | None = None) -> subprocess.Popen:
    """``python -m geomx.netem`` with ``env``, importing geomx from ``emulator_path`` (another checkout's root)
    if given. It runs from that root: ``python -m`` puts the working directory first on ``sys.path``, so started
    from this checkout's root it would import this checkout whatever ``PYTHONPATH`` says."""
    if emulator_path:
        env = {**env, "PYTHONPATH": emulator_path}
    return subprocess.Popen([sys.executable, "-m", "geomx.netem"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=emulator_path or None)


def bench_capacity(*, sizes: tuple[int, ...] = (64 * KIB, 1 * MIB), megabytes: float = 2000, window: int = 64,
                   rate_bps: float = 100e9, timeout_s: float = 120.0, emulator_path: str | None = None,
                   modes: tuple[str, ...] = CAPACITY_MODES) -> list[dict]:
    """How fast the emulator process forwards over a link of ``rate_bps`` (default: too fast to matter), and its
    CPU per MB; see the module docstring. Each of ``modes``: ``relayed``, every byte through the emulator's
    process (as across hosts), or ``parked``, the bytes straight to the receiver and only the route through it
    (geomx.transport.parking, as ``geomx launch`` on one host). ``emulator_path``: where the emulator's geomx is
    imported from (another checkout, to compare versions; default this one)."""
    from geomx.bench.common import bench_env, free_port

    port = free_port()
    env = bench_env({"GEOMX_WAN_RATE": repr(float(rate_bps)), "GEOMX_WAN_RTT": "0", "GEOMX_EMULATOR_PORT": str(port)})
    proc = start_emulator(env, emulator_path)
    inbox = _Inbox()
    address = f"tcp://127.0.0.1:{port}"
    # the vans look for its same-host channel once, when they start (an older emulator has none: 5 s lost)
    wait_for_channel(address, timeout_s=5.0 if emulator_path else 30.0, alive=lambda: proc.poll() is None)
    senders = {mode: ZmqVan(node_id=f"capacity-{mode}", dc="a", on_message=lambda m: None, emulator=address,
                            emulator_bypass=mode == "parked") for mode in modes}
    # every van of a one-host deployment may park (geomx launch): the receiver, too, takes releases off ZeroMQ
    van_c = ZmqVan(node_id="capacity-c", dc=CENTRAL_DC, on_message=inbox, emulator=address,
                   emulator_bypass="parked" in modes)
    vans = [*senders.values(), van_c]
    rows = []
    try:
        for van in vans:
            van.start()
        deadline = time.monotonic() + 30.0
        while True:     # the emulator is listening once a message crosses it
            inbox.clear()
            next(iter(senders.values())).send(van_c.address, Message("warm-up"), dst_dc=CENTRAL_DC)
            try:
                inbox.wait_for(1, 1.0)
                break
            except DeadlineError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DeadlineError(f"capacity bench: the emulator did not forward a message "
                                        f"({(proc.stderr.read() or b'').decode(errors='replace')[-500:]})") from None
        for mode, size in ((m, z) for m in modes for z in sizes):
            van_a = senders[mode]
            count = max(window, math.ceil(megabytes * 1e6 / size))
            tensor = np.zeros(size, dtype=np.uint8)
            inbox.clear()
            cpu0, t0 = process_cpu_s(proc.pid), time.monotonic()
            for i in range(count):
                if i >= window:
                    inbox.wait_for(i - window + 1, timeout_s)
                van_a.send(van_c.address, Message("bulk", fields={"i": i}, tensors=[tensor]), dst_dc=CENTRAL_DC)
            inbox.wait_for(count, timeout_s)
            seconds = inbox.arrivals[-1][0] - t0
            cpu = process_cpu_s(proc.pid) - cpu0
            rows.append({"mode": mode, "link_bps": rate_bps, "message_bytes": size, "messages": count,
                         "bytes": count * size,
                         "seconds": seconds,
                         "rate_bps": count * size * 8 / seconds, "emulator_cpu_s": cpu,
                         "cpu_ms_per_mb": cpu * 1000 / (count * size / 1e6)})
    finally:
        for van in vans:
            van.stop()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return rows


def format_capacity_report(rows: list[dict]) -> str:
    rate = rows[0]["link_bps"] if rows else 100e9
    lines = [f"### The emulator process's own capacity: a {rate / 1e9:g} Gbit/s link with no delay, 64 messages in "
             f"flight", "",
             "| payload | message size | messages | MB | time (s) | forwarded (Gbit/s) | emulator CPU (s) "
             "| CPU ms per MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {_size(r['message_bytes'])} | {r['messages']} | {r['bytes'] / 1e6:.0f} "
                     f"| {r['seconds']:.2f} "
                     f"| {r['rate_bps'] / 1e9:.2f} | {r['emulator_cpu_s']:.2f} | {r['cpu_ms_per_mb']:.3f} |")
    lines += ["", "The emulator runs as in a deployment (`python -m geomx.netem`, its own process); sender and "
                  "receiver are two vans of the benchmark's process on the same machine, which shares its cores "
                  "with them. Relayed: every byte through the emulator's process (as across hosts); parked: the "
                  "bytes straight to the receiver, which holds them until the emulator releases them (`geomx "
                  "launch` on one host, geomx.transport.parking). Emulator CPU = its user + system time over the "
                  "transfer (`/proc`)."]
    return "\n".join(lines)


def format_link_report(result: dict) -> str:
    """A markdown report of :func:`bench_link`'s result."""
    rate, line = result["rate_bps"], result["line_rate_bps"]
    tcp = ""
    if result["loss"] or result["window_bytes"] is not None or result.get("slow_start"):
        window = f", window {result['window_bytes']:,} B" if result["window_bytes"] is not None else ""
        slow = ", slow start after idle" if result.get("slow_start") else ""
        tcp = (f", loss {result['loss']:.4%}, {result['streams']} TCP stream(s){window}{slow}: the model gives "
               f"{rate / 1e6:.3g} Mbit/s ({rate / line:.1%} of the line)")
    lines = [f"### WAN link: {line / 1e6:g} Mbit/s, RTT {result['rtt_s'] * 1000:g} ms "
             f"(one-way {result['one_way_delay_s'] * 1000:g} ms), chunk {result['chunk_bytes'] // KIB} KiB{tcp}",
             "",
             "| message size | messages | MB sent | time (s) | model (s) | goodput (Mbit/s) | of rate "
             "| steady (Mbit/s) | of rate |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in result["transfers"]:
        lines.append(f"| {_size(t['message_bytes'])} | {t['messages']} | {t['bytes'] / 1e6:.2f} | {t['seconds']:.3f} "
                     f"| {t['model_s']:.3f} "
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
              f"({rate / 1e6:.3g} Mbit/s). Model: the time the link model gives the transfer (its bytes at that rate, "
              f"from the streams' initial windows with slow start, plus one one-way delay)."]
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // KIB} KiB" if n % KIB == 0 else f"{n} B"


if __name__ == "__main__":
    print(format_link_report(bench_link()))
