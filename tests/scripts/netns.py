"""Separate hosts on one machine: each a Linux network namespace with its own address, joined by a switch.

``Hosts(["central", "a", "b"], rate="100mbit")`` makes one namespace per host and one for the switch (a bridge
that no other namespace, the machine's own included, can reach), joins each host to the switch by a veth pair
and gives it ``10.<net>.0.<i>``. Traffic between hosts crosses the veths; traffic inside a host stays on its
loopback. ``rate`` shapes every host's link both ways with a token bucket (tbf: this kernel has no netem, so
there is no delay; the emulator's delay model is not used here). Everything is removed on ``close()``, the
namespaces with the processes still inside them killed.

Needs root and ``ip``/``tc`` (iproute2); :func:`unavailable` says why not where that is missing.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid

# jumbo frames: TCP/IP headers are then ~0.5% of the bytes on the wire, so the kernel's counters and geomx's
# can be compared closely
MTU = 9000


def _ip(*args: str, netns: str | None = None) -> str:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout


def _tc(netns: str, *args: str) -> str:
    cmd = ["ip", "netns", "exec", netns, "tc", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    probe = f"gx-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError) as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(RuntimeError):
        _ip("netns", "del", probe)
    return None


class Hosts:
    def __init__(self, names: list[str], *, rate: str | None = None) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.net = 100 + int(self.tag, 16) % 150          # 10.<net>.0.0/24, different for concurrent runs
        self.switch = f"gx-{self.tag}-sw"
        self.netns = {name: f"gx-{self.tag}-{name}" for name in names}
        self.address = {name: f"10.{self.net}.0.{i + 1}" for i, name in enumerate(names)}
        self.rate = rate
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for i, (name, ns) in enumerate(self.netns.items()):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "set", "lo", "up", netns=ns)
            port = f"p{i}"
            # made inside the host's namespace, the peer moved to the switch: the machine's own namespace
            # never holds either end
            _ip("link", "add", "eth0", "mtu", str(MTU), "type", "veth", "peer", "name", port, "mtu", str(MTU),
                netns=ns)
            _ip("link", "set", port, "netns", self.switch, netns=ns)
            _ip("addr", "add", f"{self.address[name]}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", port, "master", "br0", netns=self.switch)
            _ip("link", "set", port, "up", netns=self.switch)
            if self.rate:
                # egress of the host (its uplink) and of its switch port (its downlink)
                for where, dev in ((ns, "eth0"), (self.switch, port)):
                    _tc(where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256kb",
                        "latency", "100ms")

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``name``."""
        return ["ip", "netns", "exec", self.netns[name], *argv]

    def sent_bytes(self, name: str) -> int:
        """Bytes host ``name`` sent out of its link (the kernel's count, headers included)."""
        out = _ip("-s", "link", "show", "eth0", netns=self.netns[name]).splitlines()
        tx = next(i for i, line in enumerate(out) if line.strip().startswith("TX:"))
        return int(out[tx + 1].split()[0])

    def close(self) -> None:
        for ns in reversed(self._made):
            # the processes still inside die with it: kill them first so the namespace goes away at once
            with contextlib.suppress(Exception):
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                      timeout=10).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)
        self._made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
