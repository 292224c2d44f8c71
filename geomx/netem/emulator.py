"""The WAN emulator: one process that every cross-DC message passes through when emulation is on.

A van that sends to a node of another DC connects a DEALER to the emulator's ROUTER and sends
``[route, *frames]``, ``route`` being a msgpack map ``{"dst": "tcp://host:port", "src": its own address,
"src_dc", "dst_dc", "prio"}`` and ``frames`` the original message. The emulator queues the message on the
:class:`~geomx.netem.link.EmulatedLink` of ``(src_dc, dst_dc)`` (created on first use with the profile's rate,
one-way delay and jitter) and, once it has crossed the link, forwards exactly ``frames`` (the same zmq frames,
not copied) to ``dst`` through a DEALER of its own. Because all flows between two DCs cross one link object,
they really share its rate. Where the sender or the receiver has a node link of its own
(geomx.netem.node_links), or its DC a line that all its cross-DC traffic shares (geomx.netem.dc_lines), the
message crosses those too, in tandem: the sender's egress line, its DC's egress line, the DC pair's link, the
receiving DC's ingress line, the receiver's ingress line.

One thread does the work and owns every socket (ZeroMQ sockets are not thread-safe): it receives (the ROUTER),
queues each message on its links, pumps the :class:`~geomx.netem.link.LinkEngine` that serializes every link's
chunks, and forwards what is due (the DEALERs), waiting in one poll for whichever comes first: a message, or
the engine's next chunk or delivery: no hand-off between threads per message. (Its CPU per forwarded MB is
mostly ZeroMQ's and the kernel's, a message's receive and send; docs/benchmarks.md measures it.)

A parked message (geomx.transport.parking) crosses as its route alone, and its release goes back to the receiver;
on one host both take the same-host channel (geomx.transport.park_channel), whose listener and connections the
loop polls with the ROUTER.

Links count the bytes they forward (header + tensor frames, not the route frame): the ground truth for every
WAN-traffic figure. With a ``run_dir`` the counters are written to ``run_dir/wan_links.json`` every 0.5 s and at stop.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import msgpack
import zmq

from geomx.config import max_frame_bytes as frame_limit_from_env
from geomx.config import check_host, refuse_exposed_without_secret
from geomx.env_names import report_unknown
from geomx.errors import ConfigError
from geomx.netem import link_matrix
from geomx.netem import outages as outage_plan
from geomx.netem import node_links as node_link_plan
from geomx.netem import dc_lines as dc_line_plan
from geomx.netem.link import DC_EGRESS, DC_INGRESS, NODE_EGRESS, NODE_INGRESS, EmulatedLink, LinkEngine
from geomx.netem.tcp_model import TcpPath, tcp_path_from_env
from geomx.transport.security import Curve, HandshakeLog, Plain, Sealed, link_security
from geomx.profiles import WanProfile, custom_profile, get_profile, parse_duration, parse_rate
from geomx.transport import parking
from geomx.transport.park_channel import EmulatorChannel
from geomx.transport.message import payload_nbytes
from geomx.transport.refusals import RefusalLog
from geomx.transport.ids import public_name
from geomx.transport.van import is_tcp_address
import contextlib

log = logging.getLogger("geomx.netem")

# the emulator's sockets introduce themselves as this, plus a random part of each emulator: a constant identity
# let a stranger who connected first under it keep the emulator's deliveries off a node (a ROUTER refuses a
# second peer with an identity it holds)
IDENTITY_PREFIX = b"geomx-wan-emulator-"
# without a list of DCs, at most this many links (each has a thread); with one, exactly the pairs of its DCs
MAX_LINKS = 256
# distinct destinations the emulator keeps a socket to
MAX_DESTINATIONS = 1024
MAX_PATHS = 65536       # checked routes remembered (sender, receiver, DCs); beyond that the memory starts afresh
STATS_FILE = "wan_links.json"
_STATS_PERIOD_S = 0.5
_POLL_S = 0.1           # the loop looks at its stop flag at least this often
_BATCH = 64             # messages received per pass before the engine is pumped again


class WanEmulator:
    """Forwards routed messages across emulated links; see the module docstring.

    ``address`` is final once :meth:`start` has bound the socket (``port=0`` picks a free port).
    """

    def __init__(self, *, profile: WanProfile, host: str = "127.0.0.1", port: int = 0, run_dir: str | None = None,
                 chunk_bytes: int = 65536, seed: int = 0, context: zmq.Context | None = None,
                 security: Sealed | Curve | Plain | None = None, dcs: Iterable[str] | None = None,
                 hosts: Iterable[str] | None = None,
                 links: dict[tuple[str, str], link_matrix.LinkSpec] | None = None,
                 outages: outage_plan.Outages | None = None, tcp: TcpPath | None = None,
                 node_links: dict[str, float] | None = None, dc_lines: dict[str, float] | None = None,
                 max_frame_bytes: int = -1) -> None:
        """``dcs``: the DCs of the deployment (the central party included); a route naming another is dropped.
        ``hosts``: the hosts messages may be relayed to (default: this host and the loopback); the emulator
        never forwards anywhere else, so it cannot be used to reach a third party. ``links``: per-link rate
        and RTT that replace the profile's on those links (geomx.netem.link_matrix). ``outages``: partitions
        that heal, by DC, in seconds after :meth:`start` (geomx.netem.outages). ``tcp``: loss, streams and window
        that cap every link at what its TCP streams can move (geomx.netem.tcp_model). ``node_links``: nodes with
        a line of their own, by address (geomx.netem.node_links); ``dc_lines``: DCs whose cross-DC traffic shares
        one line, by name (geomx.netem.dc_lines)."""
        if not profile.emulated:
            raise ConfigError(f"WAN profile {profile.name!r} is not emulated: no emulator is needed")
        self.profile = profile
        self.link_overrides = dict(links or {})
        self.outages = dict(outages or {})
        self.tcp = tcp or TcpPath()
        self.node_rates = dict(node_links or {})
        self._node_links: dict[tuple[str, int], EmulatedLink] = {}   # (address, stage) -> its line
        # DC -> (uplink, downlink) bit/s; a single rate is a line as fast both ways
        self.dc_rates = {dc: rate if isinstance(rate, tuple) else (rate, rate) for dc, rate in (dc_lines or {}).items()}
        self._dc_lines: dict[tuple[str, int], EmulatedLink] = {}     # (DC, stage) -> its line
        self.dcs = frozenset(dcs) if dcs is not None else None
        _check_dc_lines(self.dc_rates, self.dcs)
        self.hosts = frozenset(hosts) if hosts is not None else default_hosts(host)
        self.refusals = RefusalLog(log)
        self._security = security   # with GEOMX_SECRET the emulator is a CurveZMQ peer like any node
        self._max_frame_bytes = max_frame_bytes
        self.identity = IDENTITY_PREFIX + os.urandom(8).hex().encode()
        # a parked message is one part, each of its frames within the frame limit: a route claiming more would
        # hold the link for what was never sent (a forged route of 2**40 bytes stalled it for a day)
        self.max_parked_bytes = 4 * max_frame_bytes if max_frame_bytes > 0 else 1 << 40
        self.host = host
        self._port = port
        self.run_dir = run_dir
        self.chunk_bytes = chunk_bytes
        self.seed = seed
        # an own context by default: its I/O thread must not queue behind the bulk traffic of vans that share
        # the process (benchmarks, tests), as it would not in the standalone emulator process
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._links: dict[tuple[str, str], EmulatedLink] = {}
        self._paths: dict[tuple, tuple[EmulatedLink, tuple[EmulatedLink, ...]]] = {}   # the loop's thread only
        # (receiver, over the same-host channel) -> releases due, sent after each pump
        self._releases: dict[tuple[str, bool], list[bytes]] = {}
        self._channel: EmulatorChannel | None = None
        self._links_lock = threading.Lock()
        self._router: zmq.Socket | None = None
        self._handshakes: HandshakeLog | None = None
        self._engine: LinkEngine | None = None
        self._forward_sockets: dict[str, zmq.Socket] = {}   # owned by the delivery thread
        self._threads: list[threading.Thread] = []
        self._running = False
        self._stop_stats = threading.Event()
        self._epoch = time.monotonic()
        self._t0_unix = time.time()
        self.dropped_messages = 0
        self.parked_messages = 0        # parked at their receivers: only their route and release crossed here

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> None:
        if self.run_dir:
            os.makedirs(self.run_dir, exist_ok=True)
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, 0)    # the link queues are the buffer; never push back on senders
        router.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)    # geomx.config.max_frame_bytes
        if self._security is not None:
            self._security.server(router)
        handshakes = self._handshakes = HandshakeLog(self._security)    # logs connections refused at the handshake
        handshakes.listen(router)
        if self._port:      # before the port answers: a van that finds the emulator listening finds its channel
            self._channel = EmulatorChannel.open(self.address)
        try:
            if self._port:
                router.bind(self.address)
            else:
                self._port = router.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError as exc:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
            handshakes.close(router)
            router.close()
            if self._security is not None:
                self._security.release(self._ctx)
            if self._own_context:
                self._ctx.term()
            raise ConfigError(f"WAN emulator cannot listen on {self.address}: {exc.strerror}"
                              + (" (port already in use)" if exc.errno == zmq.EADDRINUSE else "")) from None
        self._router = router
        # vans of this host hand parked messages' routes over it, off ZeroMQ (geomx.transport.park_channel)
        if self._channel is None:
            self._channel = EmulatorChannel.open(self.address)
        self._epoch = time.monotonic()
        self._t0_unix = time.time()
        self._engine = LinkEngine(driven=True)
        self._running = True
        targets = [(self._loop, "wan-emulator")]
        if self.run_dir:
            targets.append((self._stats_loop, "wan-stats"))
        for target, name in targets:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop receiving, drop what is still in flight, close the sockets and write the final stats."""
        if not self._running:
            return
        self._running = False
        self._stop_stats.set()
        for t in self._threads:
            t.join(timeout)
        with self._links_lock:
            links = [*self._links.values(), *self._node_links.values()]
        for link in links:
            link.close(timeout)
        self._engine.close(timeout)
        if self.run_dir:
            self._write_stats()
        if self._own_context:
            if any(t.is_alive() for t in self._threads):
                log.warning("WAN emulator threads did not stop within %.1f s; leaving its zmq context open", timeout)
            else:
                self._ctx.term()    # all sockets are closed: returns once lingering frames have left

    def stats(self) -> dict:
        with self._links_lock:
            items = list(self._links.items())
            nodes = sorted(self._node_links.items())
            dc_lines = sorted(self._dc_lines.items())
        links = {}
        for (src, dst), link in sorted(items):
            snap = link.snapshot()
            del snap["name"]
            links[f"{src}->{dst}"] = {"src_dc": src, "dst_dc": dst, **snap}
        node_links = {link.name: {"address": addr, "direction": "in" if stage == NODE_INGRESS else "out",
                                  **link.snapshot()} for (addr, stage), link in nodes}
        dcs = {link.name: {"dc": dc, "direction": "in" if stage == DC_INGRESS else "out", **link.snapshot()}
               for (dc, stage), link in dc_lines}
        return {"profile": self.profile.name, "address": self.address, "t0_unix": self._t0_unix,
                "elapsed_s": time.monotonic() - self._epoch, "dropped_messages": self.dropped_messages,
                "parked_messages": self.parked_messages,
                "links": links, "node_links": node_links, "dc_lines": dcs}

    def link(self, src_dc: str, dst_dc: str) -> EmulatedLink:
        """The link src_dc -> dst_dc, created on first use; ValueError for DCs outside the configuration."""
        with self._links_lock:
            link = self._links.get((src_dc, dst_dc))
            if link is None:
                if self.dcs is not None and not (src_dc in self.dcs and dst_dc in self.dcs):
                    raise ValueError(f"route {src_dc!r} -> {dst_dc!r} names a DC outside this deployment "
                                     f"({', '.join(sorted(self.dcs))})")
                if src_dc == dst_dc or len(self._links) >= MAX_LINKS:
                    raise ValueError(f"route {src_dc!r} -> {dst_dc!r} refused: a DC's own traffic or one link "
                                     f"more than the {MAX_LINKS} allowed")
                spec = self.link_overrides.get((src_dc, dst_dc))
                link = self._links[(src_dc, dst_dc)] = EmulatedLink(
                    name=f"{src_dc}->{dst_dc}",
                    rate_bps=spec.rate_bps if spec else self.profile.rate_for(src_dc, dst_dc),
                    one_way_delay_s=spec.rtt_s / 2 if spec else self.profile.one_way_delay_s,
                    jitter_s=spec.jitter_s if spec and spec.jitter_s is not None else self.profile.jitter_s,
                    chunk_bytes=self.chunk_bytes, seed=self.seed, engine=self._engine, epoch=self._epoch,
                    outages=outage_plan.for_link(self.outages, src_dc, dst_dc),
                    tcp=spec.tcp(self.tcp) if spec else self.tcp)
            return link

    def node_link(self, addr: str, stage: int) -> EmulatedLink | None:
        """The line of the node at ``addr`` in one direction (``NODE_INGRESS`` or ``NODE_EGRESS``), created on
        first use; None where the node has none."""
        return self._line(self._node_links, self.node_rates.get(addr), addr, stage, _node_line_name)

    def dc_line(self, dc: str, stage: int) -> EmulatedLink | None:
        """DC ``dc``'s own line in one direction (``DC_INGRESS`` or ``DC_EGRESS``), created on first use; None
        where the DC has none."""
        rates = self.dc_rates.get(dc)
        return self._line(self._dc_lines, None if rates is None else rates[0 if stage == DC_EGRESS else 1], dc,
                          stage, _dc_line_name)

    def _line(self, lines: dict, rate: float | None, owner: str, stage: int,
              name_of: Callable[[str, int], str]) -> EmulatedLink | None:
        """A line of ``rate`` without delay of its own (a node's, a DC's), in tandem with the pair links; None
        without a rate. Every message asks for its ends' lines: the name is made only when a line is."""
        if rate is None:
            return None
        with self._links_lock:
            link = lines.get((owner, stage))
            if link is None:
                link = lines[(owner, stage)] = EmulatedLink(
                    name=name_of(owner, stage), rate_bps=rate, one_way_delay_s=0.0, chunk_bytes=self.chunk_bytes,
                    engine=self._engine, epoch=self._epoch, stage=stage)
            return link

    # -- threads -----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        router, handshakes = self._router, self._handshakes
        channel = self._channel
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        if handshakes.socket is not None:
            poller.register(handshakes.socket, zmq.POLLIN)
        if channel is not None:
            channel.attach(poller)
        wake = 0.0
        try:
            while self._running:
                now = time.monotonic()
                if now >= wake:
                    wake = self._engine.pump(now)
                    self._send_releases()
                left = min(wake - time.monotonic(), _POLL_S)
                if channel is not None and channel.waiting:     # its listener rests: the process ran out of files
                    left = min(left, channel.service(time.monotonic()))
                # zmq's poll counts whole milliseconds: under one, take what has arrived, then sleep the rest
                ready = poller.poll(int(left * 1000) if left >= 0.001 else 0)
                if ready:
                    for sock, events in ready:
                        if sock is router:
                            self._receive_routed(router)
                        elif sock is handshakes.socket:
                            handshakes.read()
                        else:
                            for van, packet in channel.ready(sock, events):
                                self._route_safely(packet, van=van)
                    # what arrived takes its line when it arrived, whenever the engine is pumped: pump when its
                    # first delivery can be due, not now (a pass of its own cost a message ~10% of the loop)
                    wake = min(wake, self._engine.next_due())
                elif 0 < left < 0.001:
                    time.sleep(left)
        finally:
            if channel is not None:
                channel.close()
            handshakes.close(router)
            router.close(linger=0)
            self._close_forward_sockets()
            if self._security is not None:
                self._security.release(self._ctx)   # the router is closed: its connection checker can stop

    def _receive_routed(self, router: zmq.Socket) -> None:
        for _ in range(_BATCH):
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._route_safely(frames)

    def _route_safely(self, frames: list | bytes, *, van: str | None = None) -> None:
        """Queue one message (ZeroMQ's frames), or one parked message's route from the same-host channel of the
        van receiving at ``van`` (its packet)."""
        try:
            if van is None:
                self._route(frames)
            else:
                self._route_parked(frames)
        except Exception as exc:    # malformed input is dropped, never fatal
            self.dropped_messages += 1
            # a node's ZeroMQ identity is its id: logs show its public part
            peer = van if van is not None else bytes(frames[0].bytes)
            self.refusals.note(peer, "WAN emulator dropped a message from %r: %s", public_name(peer), exc)

    def _route(self, frames: list) -> None:
        if len(frames) < 2:
            raise ValueError("expected [route, header, tensors...] or a parked message's [route], got no frame")
        self._queue(_read_route(frames[1].buffer), frames[2:], channel=False)

    def _route_parked(self, packet: bytes) -> None:
        route = _read_route(packet)
        if route.get("park") is None:
            raise ValueError("a route on the same-host channel that is not a parked message's")
        self._queue(route, (), channel=True)

    def _queue(self, route: dict, payload, *, channel: bool) -> None:
        """Queue a message on its path: ``payload``, the frames to forward, or a parked one's release, due over the
        same-host channel where the route came over it (so each sender's messages to a receiver keep one path)."""
        dst, src_dc, dst_dc, prio = route.get("dst"), route.get("src_dc"), route.get("dst_dc"), route.get("prio", 0)
        src = route.get("src")
        src = src if isinstance(src, str) else None
        try:                # checked and looked up once per (sender, receiver, DCs): the same every later time
            path = self._paths.get((src, dst, src_dc, dst_dc))
        except TypeError:   # a list or a map where a name belongs: _new_path says which
            path = None
        if path is None:
            path = self._new_path(src, dst, src_dc, dst_dc)
        if not isinstance(prio, int) or isinstance(prio, bool):
            raise ValueError(f"route priority is not an int: {prio!r}")
        park = route.get("park")
        if park is None:            # the message itself, to forward
            if not payload:
                raise ValueError("a route without the message behind it (and not a parked one's)")
            nbytes = payload_nbytes(payload)
        else:                       # parked at its receiver (geomx.transport.parking): forward its release
            nbytes = route.get("n")
            if not (isinstance(park, bytes) and len(park) == parking.ID_BYTES and isinstance(nbytes, int)
                    and not isinstance(nbytes, bool) and 0 <= nbytes <= self.max_parked_bytes and not payload):
                raise ValueError(f"a parked message's route needs a {parking.ID_BYTES}-byte id and its size "
                                 f"alone (at most {self.max_parked_bytes} bytes: four frames of the frame limit), "
                                 f"got park={park!r}, n={nbytes!r}, {len(payload)} frame(s) behind it")
            self.parked_messages += 1
            release = parking.marker(parking.RELEASE, park)
            due = (dst, channel)
            path[0].enqueue(nbytes, prio, lambda: self._releases.setdefault(due, []).append(release), then=path[1])
            return
        first, then = path
        first.enqueue(nbytes, prio, lambda: self._relay(dst, payload), then=then)

    def _new_path(self, src: str | None, dst, src_dc, dst_dc) -> tuple[EmulatedLink, tuple[EmulatedLink, ...]]:
        """The links a message from ``src`` to ``dst`` crosses, in order, after checking the route's ends (a
        ValueError names what is wrong); remembered for the next message between the same ends."""
        if not is_tcp_address(dst):
            raise ValueError(f"route has no tcp://host:port destination: {dst!r}")
        if dst[6:].rpartition(":")[0] not in self.hosts or dst == self.address:
            raise ValueError(f"route to {dst!r} refused: the emulator relays only to the hosts "
                             f"{', '.join(sorted(self.hosts))} (GEOMX_EMULATOR_HOSTS)")
        if not (isinstance(src_dc, str) and isinstance(dst_dc, str) and src_dc and dst_dc):
            raise ValueError(f"route lacks src_dc/dst_dc: {src_dc!r} -> {dst_dc!r}")
        links = [self.node_link(src, NODE_EGRESS) if src is not None else None, self.dc_line(src_dc, DC_EGRESS),
                 self.link(src_dc, dst_dc), self.dc_line(dst_dc, DC_INGRESS), self.node_link(dst, NODE_INGRESS)]
        first, *then = [link for link in links if link is not None]
        if len(self._paths) >= MAX_PATHS:
            self._paths.clear()
        path = self._paths[(src, dst, src_dc, dst_dc)] = (first, tuple(then))
        return path

    def _relay(self, dst: str, frames: list) -> None:
        """A delivery of a relayed message: after the releases already due to the same receiver (one socket
        keeps the order the link model gave them)."""
        self._send_releases(only=(dst, False))
        self._forward(dst, frames)

    def _send_releases(self, *, only: tuple[str, bool] | None = None) -> None:
        """The releases of parked messages the last pump delivered (``only``: those to one receiver over one
        path): one message per receiver, a frame each (several are often due in one pump; a message each cost the
        emulator a send and its I/O thread a wake-up); over the same-host channel where the route came over it and
        the receiver has one."""
        if not self._releases:
            return
        if only is None:
            batches, self._releases = self._releases, {}
        else:
            marks = self._releases.pop(only, None)
            batches = {only: marks} if marks else {}
        for (dst, channel), marks in batches.items():
            if channel and self._channel.release(dst, marks):
                continue
            try:
                self._forward(dst, marks)
            except Exception as exc:      # counted as delivered by the links; the receiver drops them in time
                self.dropped_messages += len(marks)
                self.refusals.note(dst, "WAN emulator could not release %d parked message(s) to %r: %s",
                                   len(marks), dst, exc)

    def _forward(self, dst: str, frames: list) -> None:
        """The emulator's thread only (a delivery): send the original frames to the destination's ROUTER."""
        sock = self._forward_sockets.get(dst)
        if sock is None:
            if len(self._forward_sockets) >= MAX_DESTINATIONS:
                self.dropped_messages += 1
                self.refusals.note(dst, "WAN emulator dropped a message to %r: already forwarding to %d "
                                   "destinations", dst, MAX_DESTINATIONS)
                return
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.identity)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            if self._security is not None:
                self._security.client(sock)
            try:
                sock.connect(dst)
            except zmq.ZMQError:
                sock.close()
                raise
            self._forward_sockets[dst] = sock
        sock.send_multipart(frames, copy=False)

    def _close_forward_sockets(self) -> None:
        for sock in self._forward_sockets.values():
            sock.close(linger=200)  # give frames already handed to zmq a moment to leave
        self._forward_sockets.clear()

    def _stats_loop(self) -> None:
        while True:
            try:
                self._write_stats()
            except OSError as exc:
                log.warning("WAN emulator cannot write %s: %s", os.path.join(self.run_dir, STATS_FILE), exc)
            if self._stop_stats.wait(_STATS_PERIOD_S):
                return

    def _write_stats(self) -> None:
        # write a temp file then rename: a reader never sees a half-written file
        fd, tmp = tempfile.mkstemp(prefix=".wan_links.", suffix=".tmp", dir=self.run_dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.stats(), f)
            os.replace(tmp, os.path.join(self.run_dir, STATS_FILE))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _read_route(buffer) -> dict:
    try:
        route = msgpack.unpackb(buffer, raw=False)
    except Exception as exc:
        raise ValueError(f"route frame is not msgpack ({exc.__class__.__name__})") from None
    if not isinstance(route, dict):
        raise ValueError("route frame is not a map")
    return route


def _node_line_name(addr: str, stage: int) -> str:
    return f"{addr.removeprefix('tcp://')} {'in' if stage == NODE_INGRESS else 'out'}"


def _dc_line_name(dc: str, stage: int) -> str:
    return f"DC {dc} {'in' if stage == DC_INGRESS else 'out'}"


# -- standalone process ------------------------------------------------------------------------------------

def profile_from_env(env: Mapping[str, str]) -> WanProfile:
    """GEOMX_WAN_PROFILE, or GEOMX_WAN_RATE (bit/s, or with its unit) + GEOMX_WAN_RTT (seconds, or with its unit)
    + optional GEOMX_WAN_JITTER (likewise)."""
    name = env.get("GEOMX_WAN_PROFILE")
    if name:
        try:
            profile = get_profile(name)
        except ConfigError as exc:
            raise ConfigError(f"GEOMX_WAN_PROFILE: {exc}") from None
        if not profile.emulated:
            raise ConfigError(f"GEOMX_WAN_PROFILE={name} is not emulated: no emulator is needed")
        return profile
    if not env.get("GEOMX_WAN_RATE") or not env.get("GEOMX_WAN_RTT"):
        raise ConfigError("the WAN emulator needs GEOMX_WAN_PROFILE, or GEOMX_WAN_RATE (bit/s) and GEOMX_WAN_RTT (s)")
    try:
        rate = parse_rate(env["GEOMX_WAN_RATE"])
    except ConfigError as exc:
        raise ConfigError(f"GEOMX_WAN_RATE: {exc}") from None
    rtt = _env_seconds(env, "GEOMX_WAN_RTT")
    jitter = _env_seconds(env, "GEOMX_WAN_JITTER") if env.get("GEOMX_WAN_JITTER") else 0.0
    try:
        return custom_profile(rate, rtt, jitter)
    except ConfigError as exc:
        raise ConfigError(f"GEOMX_WAN_RATE/GEOMX_WAN_RTT/GEOMX_WAN_JITTER: {exc}") from None


# a bare GEOMX_WAN_RTT or GEOMX_WAN_JITTER is seconds (a bare --wan-rtt is milliseconds): one above this is surely
# milliseconds meant, GEOMX_WAN_RTT=40 read as a 40 s RTT
MAX_BARE_SECONDS = 10.0


def _env_seconds(env: Mapping[str, str], var: str) -> float:
    """A plain number of seconds (at most MAX_BARE_SECONDS), or a duration with its unit such as '80ms'."""
    text = env[var].strip()
    try:
        seconds = float(text)
    except ValueError:
        if text.lower().endswith("s"):
            try:
                return parse_duration(text)
            except ConfigError as exc:
                raise ConfigError(f"{var}: {exc}") from None
        raise ConfigError(f"{var}={text!r} is not a duration: seconds (0.04) or with its unit (40ms)") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"{var}={text!r} must be a finite number of seconds >= 0")
    if seconds > MAX_BARE_SECONDS:
        raise ConfigError(f"{var}={text!r} reads as {seconds:g} seconds, surely a unit slip: write the unit "
                          f"({text}ms, or {text}s if seconds are meant)")
    return seconds


def emulator_options(env: Mapping[str, str], *, resolve: bool = True) -> dict:
    """The WanEmulator's arguments from the environment (see run_from_env), every variable parsed and checked as the
    emulator does, a ConfigError naming the variable: what ``geomx doctor`` checks an emulator's environment with.
    ``resolve``: a host name in GEOMX_EMULATOR_HOST must resolve (geomx.config.check_host)."""
    profile = profile_from_env(env)
    host = check_host("GEOMX_EMULATOR_HOST", env.get("GEOMX_EMULATOR_HOST") or "127.0.0.1", "GEOMX_EMULATOR_PORT",
                      resolve=resolve)
    port_text = env.get("GEOMX_EMULATOR_PORT")
    if not port_text:
        raise ConfigError("GEOMX_EMULATOR_PORT is not set: the WAN emulator needs a port to listen on")
    try:
        port = int(port_text)
        if not 0 <= port <= 65535:
            raise ValueError
    except ValueError:
        raise ConfigError(f"GEOMX_EMULATOR_PORT={port_text!r} is not a port number") from None
    dcs, hosts = (env.get(var, "").replace(",", " ").split() or None
                  for var in ("GEOMX_EMULATOR_DCS", "GEOMX_EMULATOR_HOSTS"))
    security = link_security(env)
    refuse_exposed_without_secret("the WAN emulator", (host,), security, env)
    dc_lines = dc_line_plan.parse(env.get(dc_line_plan.ENV))
    _check_dc_lines(dc_lines, dcs)
    return dict(profile=profile, host=host, port=port, run_dir=env.get("GEOMX_RUN_DIR") or None,
                security=security, dcs=dcs, hosts=hosts, links=link_matrix.from_env(env.get(link_matrix.ENV), dcs),
                outages=outage_plan.from_env(env.get(outage_plan.ENV), dcs), tcp=tcp_path_from_env(env),
                node_links=node_link_plan.parse(env.get(node_link_plan.ENV)), dc_lines=dc_lines,
                max_frame_bytes=frame_limit_from_env(env))


def default_hosts(host: str) -> frozenset[str]:
    """The hosts an emulator on ``host`` relays to without GEOMX_EMULATOR_HOSTS."""
    return frozenset({host, "127.0.0.1", "localhost"})


def _check_dc_lines(dc_rates, dcs) -> None:
    unknown = sorted(set(dc_rates) - set(dcs)) if dcs is not None else []
    if unknown:
        raise ConfigError(f"{dc_line_plan.ENV}: DC line(s) for {', '.join(unknown)}, which is no DC of this "
                          f"deployment ({', '.join(sorted(dcs))})")


def run_from_env(env: Mapping[str, str] | None = None) -> int:
    """Run an emulator configured by environment variables until SIGTERM/SIGINT; returns the exit status 0.

    GEOMX_WAN_PROFILE or GEOMX_WAN_RATE (bit/s) + GEOMX_WAN_RTT [+ GEOMX_WAN_JITTER] (seconds; units may be
    written: 100mbit, 40ms); GEOMX_EMULATOR_HOST (default
    127.0.0.1), GEOMX_EMULATOR_PORT (required), GEOMX_RUN_DIR (optional: where wan_links.json goes),
    GEOMX_EMULATOR_DCS (optional: the DCs, comma-separated, central included; routes naming others are
    dropped), GEOMX_EMULATOR_HOSTS (optional: the hosts it may relay to; default its own host and loopback),
    GEOMX_WAN_LINKS (optional: per-link rate and RTT, geomx.netem.link_matrix),
    GEOMX_WAN_OUTAGES (optional: partitions that heal, by DC, geomx.netem.outages),
    GEOMX_WAN_LOSS / GEOMX_WAN_STREAMS / GEOMX_WAN_WINDOW / GEOMX_WAN_SLOW_START (optional: the TCP ceiling and
    slow start after idle, geomx.netem.tcp_model), GEOMX_WAN_NODE_LINKS (optional: nodes with a line of their own,
    geomx.netem.node_links), GEOMX_WAN_DC_LINES (optional: DCs whose traffic shares a line, geomx.netem.dc_lines).
    """
    env = os.environ if env is None else env
    report_unknown(env, "the WAN emulator")     # a misspelled GEOMX_WAN_* would be ignored in silence
    options = emulator_options(env)
    profile = options["profile"]
    # a 5 ms GIL switch interval would let the receive loop delay a due delivery by up to 5 ms under load
    sys.setswitchinterval(0.0005)
    emulator = WanEmulator(**options)

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        emulator.start()
        log.info("WAN emulator listening on %s (profile %s: %s, up %.6g bit/s, down %.6g bit/s, one-way delay "
                 "%.6g s, jitter %.6g s)", emulator.address, profile.name, profile.description,
                 profile.uplink_bps, profile.downlink_bps, profile.one_way_delay_s, profile.jitter_s)
        while not stop.wait(0.5):
            pass
        log.info("WAN emulator stopping")
    finally:
        emulator.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
