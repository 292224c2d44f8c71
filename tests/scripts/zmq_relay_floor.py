"""The CPU floor of a process that relays small ZeroMQ messages one at a time (docs/benchmarks.md, "Where a paced
message's CPU goes").

    python tests/scripts/zmq_relay_floor.py [--messages 6000] [--gap-us 300] [--repeats 2]

A parked message costs the WAN emulator one small message in (its route) and one out (its release). On a paced
link, each message arrives on its own, so the process wakes for each one. This script measures that part alone.
A relay process receives each message on a ROUTER and sends it on through a DEALER, with no model and no
bookkeeping. The sender keeps one message in flight and waits ``--gap-us`` between them, as a paced link spaces
them. Each row is the relay's user+system CPU per message, over TCP on the loopback (what geomx uses) and over
ipc:// (Unix sockets).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import zmq


def _relay(inbound: str, outbound: str, messages: int, results) -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(inbound)
    dealer.connect(outbound)
    results.put(router.getsockopt_string(zmq.LAST_ENDPOINT))     # where it listens (tcp: a port of its own)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    start, relayed = os.times(), 0
    deadline = time.monotonic() + 120
    while relayed < messages and time.monotonic() < deadline:
        if not poller.poll(1000):
            continue
        while True:
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            dealer.send_multipart(frames[1:], copy=False)
            relayed += 1
    end = os.times()
    results.put((end.user - start.user + end.system - start.system) / max(relayed, 1) * 1e6)
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


def measure(transport: str, *, messages: int, gap_s: float, folder: str) -> float:
    """The relay's CPU in microseconds per message."""
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
        time.sleep(0.3)             # the connection is up before the first message counts
        payload = b"r" * 100        # about a route's size
        for _ in range(messages):
            sender.send(payload)
            back.recv_multipart()   # one in flight: the next leaves after this one was relayed
            time.sleep(gap_s)
        us = results.get(timeout=30)
    finally:
        relay.join(5)
        if relay.is_alive():
            relay.kill()
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
        for transport in ("tcp", "ipc"):
            runs = [measure(transport, messages=args.messages, gap_s=args.gap_us / 1e6, folder=folder)
                    for _ in range(args.repeats)]
            print(f"| {transport} | {', '.join(f'{us:.1f}' for us in runs)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
