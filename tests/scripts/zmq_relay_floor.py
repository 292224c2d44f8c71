"""The CPU floor of a process that relays small ZeroMQ messages one at a time (docs/benchmarks.md, "Where a paced
message's CPU goes").

    python tests/scripts/zmq_relay_floor.py [--messages 6000] [--gap-us 300] [--repeats 2]

A parked message costs the WAN emulator one small message in (its route) and one out (its release). On a paced
link, each message arrives on its own, so the process wakes for each one. This script measures that part alone.
A relay process receives each message on a ROUTER and sends it on through a DEALER, with no model and no
bookkeeping. The sender keeps one message in flight and waits ``--gap-us`` between them, as a paced link spaces
them. Each row is the relay's user+system CPU per message, over TCP on the loopback (what geomx used for routes and
releases before session 39), over ipc:// (ZeroMQ on Unix sockets), and over plain Unix ``SOCK_SEQPACKET`` sockets
without ZeroMQ (``unix``: what the same-host channel, geomx.transport.park_channel, uses since).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import socket
import tempfile
import time

import zmq


def _relay_loop(poll, receive, send, messages: int) -> float:
    """Relay ``messages`` one by one (``receive()``: the next, or None when nothing is waiting); the CPU
    microseconds per message."""
    start, relayed = os.times(), 0
    deadline = time.monotonic() + 120
    while relayed < messages and time.monotonic() < deadline:
        if not poll(1000):
            continue
        while (item := receive()) is not None:
            send(item)
            relayed += 1
    end = os.times()
    return (end.user - start.user + end.system - start.system) / max(relayed, 1) * 1e6


def _zmq_receive(router: zmq.Socket):
    try:
        return router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None


def _relay(inbound: str, outbound: str, messages: int, results) -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(inbound)
    dealer.connect(outbound)
    results.put(router.getsockopt_string(zmq.LAST_ENDPOINT))     # where it listens (tcp: a port of its own)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    results.put(_relay_loop(poller.poll, lambda: _zmq_receive(router),
                            lambda frames: dealer.send_multipart(frames[1:], copy=False), messages))
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


def _unix_receive(conn: socket.socket) -> bytes | None:
    try:
        return conn.recv(65536)
    except BlockingIOError:
        return None


def _unix_relay(inbound: str, outbound: str, messages: int, results) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(inbound)
    listener.listen(1)
    results.put(inbound)
    conn, _ = listener.accept()
    out = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    out.connect(outbound)
    conn.setblocking(False)
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    results.put(_relay_loop(poller.poll, lambda: _unix_receive(conn), out.send, messages))
    for sock in (conn, out, listener):
        sock.close()


def measure_unix(*, messages: int, gap_s: float, folder: str) -> float:
    """The same relay over plain Unix SOCK_SEQPACKET sockets: CPU microseconds per message."""
    inbound, outbound = f"{folder}/unix-in", f"{folder}/unix-out"
    for path in (inbound, outbound):
        if os.path.exists(path):
            os.unlink(path)
    back = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    back.bind(outbound)
    back.listen(1)
    results = mp.Queue()
    relay = mp.Process(target=_unix_relay, args=(inbound, outbound, messages, results), daemon=True)
    relay.start()
    try:
        results.get(timeout=30)
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sender.connect(inbound)
        back.settimeout(30)
        receiver, _ = back.accept()
        receiver.settimeout(5)
        us = _drive(sender.send, lambda: receiver.recv(65536), results, messages=messages, gap_s=gap_s)
    finally:
        _stop(relay)
    for sock in (sender, receiver, back):
        sock.close()
    return us


def _drive(send, receive, results, *, messages: int, gap_s: float) -> float:
    """Send ``messages`` through the relay one at a time, ``gap_s`` apart; the relay's CPU per message."""
    time.sleep(0.3)             # the connection is up before the first message counts
    payload = b"r" * 100        # about a route's size
    for _ in range(messages):
        send(payload)
        receive()               # one in flight: the next leaves after this one was relayed
        time.sleep(gap_s)
    return results.get(timeout=30)


def _stop(relay: mp.Process) -> None:
    relay.join(5)
    if relay.is_alive():
        relay.kill()


def measure(transport: str, *, messages: int, gap_s: float, folder: str) -> float:
    """The relay's CPU in microseconds per message."""
    if transport == "unix":
        return measure_unix(messages=messages, gap_s=gap_s, folder=folder)
    if transport == "tcp":
        inbound, outbound = "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"
    else:
        inbound, outbound = f"ipc://{folder}/in", f"ipc://{folder}/out"
    ctx = zmq.Context()
    back = ctx.socket(zmq.ROUTER)
    back.bind(outbound)
    outbound = back.getsockopt_string(zmq.LAST_ENDPOINT)
    results = mp.Queue()
    relay = mp.Process(target=_relay, args=(inbound, outbound, messages, results), daemon=True)
    relay.start()
    try:
        inbound = results.get(timeout=30)
        sender = ctx.socket(zmq.DEALER)
        sender.connect(inbound)
        back.setsockopt(zmq.RCVTIMEO, 5000)
        us = _drive(sender.send, back.recv_multipart, results, messages=messages, gap_s=gap_s)
    finally:
        _stop(relay)
    sender.close(linger=0)
    back.close(linger=0)
    ctx.term()
    return us


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, default=6000)
    p.add_argument("--gap-us", type=float, default=300.0, help="pause between messages (default 300 us)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print("| transport | relay CPU per message (us), each run |")
        print("|---|---|")
        for transport in ("tcp", "ipc", "unix"):
            runs = [measure(transport, messages=args.messages, gap_s=args.gap_us / 1e6, folder=folder)
                    for _ in range(args.repeats)]
            print(f"| {transport} | {', '.join(f'{us:.1f}' for us in runs)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
