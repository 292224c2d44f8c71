"""Emulated WAN links and the one thread that drives all of an emulator's links.

The model of a link is one serial line of ``rate_bps`` followed by a propagation delay:

* Messages wait in a queue ordered by (priority desc, arrival asc); on a line that several links feed (a node's),
  equal priorities take their chunks in the order the chunks reached it. The line serializes one chunk at a time, so
  a higher-priority message that arrives while a bulk message is half sent overtakes it at the next chunk
  boundary; equal priorities stay FIFO. A chunk is ``chunk_bytes`` or, on a fast line, what the line carries in
  ``CHUNK_SECONDS`` (so overtaking waits at most that long, and a fast line costs no more chunks per second
  than a slow one).
* Serialization runs on a virtual clock: a chunk occupies the line from ``max(busy_until, ready)`` for its bytes
  at the line's rate (``ready``: when its message was enqueued, or reached this link). The engine commits
  chunks only while the virtual clock is at most ``LOOKAHEAD_S`` ahead of real time, and back-dates the chunks
  it commits when it comes late, instead of leaving the line idle, so goodput stays at the rate and deliveries
  keep their virtual times (a late one is made at once). So it needs no wake-up to keep a line busy: it wakes
  when the next delivery can be due (a lower bound from the bytes queued, exact for a message alone on a line of
  constant rate) or a message is enqueued, and commits everything up to then at once. On such a line a message
  that the last link of its path carries, and that nothing queued could interrupt before the horizon, is
  committed as one chunk, not many.
* A message whose last chunk ends at ``tx_end`` is delivered at ``tx_end + one_way_delay + jitter``, jitter
  drawn from a seeded normal distribution (std ``jitter_s``, clipped to +-2 std), but never before the previous
  delivery on the same link: a TCP connection does not reorder.
* Outages (``outages``: (start, end) in seconds since ``epoch``) model a partition that heals: the line carries
  nothing while one lasts, and a delivery that would fall inside one is made when it ends (what was on the wire
  is retransmitted once the path is back, as TCP does for a partition shorter than its timeouts).
  (start, end, rate) slows the line instead: a chunk that starts in that window is serialized at that rate.
* ``tcp`` (a :class:`geomx.netem.tcp_model.TcpPath`): loss and the streams' window cap the line's rate at what
  that many TCP streams move over the link's RTT; the line then serializes at that goodput. With
  ``slow_start`` a line idle for longer than the retransmission timeout restarts from the streams' initial
  windows and doubles its rate every RTT back to that goodput (Linux's ``tcp_slow_start_after_idle``).

Links in tandem (``enqueue(..., then=[links])``): a message crosses each link in turn, chunk by chunk: a chunk
that leaves one link (plus that link's delay) is ready on the next, so a message streams through a WAN link
into a node's own link (``geomx.netem.node_links``) the way packets do, and several DCs' traffic into one node
shares that node's line. Every link of a path must be driven by the same :class:`LinkEngine`.

One :class:`LinkEngine` thread serializes the chunks of every link attached to it (node egress links first, then
WAN links, then node ingress links, so a chunk handed on is seen in the same pass) and calls each message's
``deliver()`` at its time. A link made without an engine owns one.

Not modelled: the sawtooth of congestion avoidance (loss is a mean rate, Mathis), retransmitted bytes,
per-packet header overhead.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable

from geomx.errors import ConfigError, GeomxError
from geomx.netem.outages import problem as outage_problem
from geomx.netem.tcp_model import TcpPath

log = logging.getLogger("geomx.netem")

LOOKAHEAD_S = 0.002     # how far the virtual clock may run ahead of real time before the engine sleeps
CHUNK_SECONDS = 0.0005  # on a fast line a chunk is what it carries in this long (at least chunk_bytes)
_IDLE_WAIT_S = 0.5      # every wait has a timeout, so a lost notify or a close is noticed

# the stages of a path, in the order the engine serves them within one pass: a node's own line, its DC's line,
# the DC pair's link, the receiving DC's line, the receiving node's line
NODE_EGRESS, DC_EGRESS, WAN, DC_INGRESS, NODE_INGRESS = 0, 1, 2, 3, 4

_arrivals = itertools.count()   # messages in the order they were enqueued, on any link: FIFO among equals


class LinkEngine:
    """Serializes the chunks of every attached link and calls deliveries at their times.

    Driven by its own thread, or (``driven=True``) by a caller's event loop that calls :meth:`pump` whenever the
    time it returned has come, or the time :meth:`next_due` gives after it enqueued messages: the WAN emulator
    does, so that receiving, serializing and forwarding take one thread and no hand-offs. ``schedule(at, fn)``
    calls ``fn()`` at monotonic time ``at``, in (time, arrival) order, on the thread that pumps, so a callback
    may use sockets that only that thread owns; ``on_exit`` runs in the engine's own thread when it stops (the
    place to close those sockets).
    """

    def __init__(self, *, name: str = "wan-engine", on_exit: Callable[[], None] | None = None,
                 driven: bool = False) -> None:
        self.cv = threading.Condition()       # guards the engine and the state of every attached link
        self._links: list[EmulatedLink] = []
        self._deliveries: list = []            # heap of (at, seq, fn)
        self._seq = itertools.count()          # ties on time keep arrival order
        self._closed = False
        self._kicked = False                   # something was enqueued or scheduled since the last pump
        self._due = float("inf")               # the soonest any of it can be delivered
        self._on_exit = on_exit
        self._thread = None if driven else threading.Thread(target=self._run, name=name, daemon=True)
        if self._thread is not None:
            self._thread.start()

    def attach(self, link: EmulatedLink) -> None:
        with self.cv:
            self._links.append(link)
            self._links.sort(key=lambda lk: lk.stage)

    def detach(self, link: EmulatedLink) -> None:
        with self.cv:
            if link in self._links:
                self._links.remove(link)

    def schedule(self, at: float, fn: Callable[[], None]) -> None:
        with self.cv:
            self._push(at, fn)
            self.kick(at)

    def kick(self, due: float = 0.0) -> None:
        """(With the lock held.) Wake the engine's thread: there is new work, none of it due before ``due``."""
        self._kicked = True
        self._due = min(self._due, due)
        self.cv.notify()

    def next_due(self) -> float:
        """For a driven engine's caller after it enqueued messages: the soonest any of them can be delivered. Pumping
        then, not at once, is enough: a pump back-dates the chunks it commits, so a message that reached an idle
        line, or overtakes queued ones, takes the line when it arrived, whenever the pump runs."""
        with self.cv:
            due, self._due = self._due, float("inf")
            return due

    def _push(self, at: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._deliveries, (at, next(self._seq), fn))

    def close(self, timeout: float = 2.0) -> None:
        """Stop the engine (its thread, if it has one); deliveries not yet due are dropped."""
        with self.cv:
            self._closed = True
            self.cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def pump(self, now: float | None = None) -> float:
        """Commit the chunks whose line time starts within ``LOOKAHEAD_S``, make the deliveries that are due;
        returns the monotonic time at which to pump again: the next delivery, or the soonest one that work not
        yet committed could make (sooner if a message is enqueued: :meth:`next_due`)."""
        now = time.monotonic() if now is None else now
        handed: list = []
        with self.cv:
            self._kicked, self._due = False, float("inf")
            wake = now + _IDLE_WAIT_S
            # in stage order: a chunk handed on is served in the same pass
            waiting = [link for link in self._links if link._commit(now + LOOKAHEAD_S, handed) is not None]
            foreign = []
            for target, at, fn in handed:
                if target is self:
                    self._push(at, fn)
                else:
                    foreign.append((target, at, fn))
            due = []
            while self._deliveries and self._deliveries[0][0] <= now:
                due.append(heapq.heappop(self._deliveries)[2])
            if self._deliveries:
                wake = min(wake, self._deliveries[0][0])
            # a line with work left uncommitted: come back when its first delivery could be due, not to keep the
            # line busy (a late pump back-dates its chunks, and an arrival pumps the engine anyway)
            for link in waiting:
                if link._landing_floor() < wake:      # else a committed delivery comes first: no need to look
                    wake = min(wake, link._soonest_landing())
        for target, at, fn in foreign:     # a delivery scheduler of another kind (a test's recorder)
            target.schedule(at, fn)
        for fn in due:
            try:
                fn()
            except Exception:   # one bad delivery must not stop all links
                log.exception("WAN emulator failed to deliver a message")
        return wake

    def _run(self) -> None:
        try:
            wake = time.monotonic()
            while True:
                with self.cv:
                    while not self._closed and not self._kicked:
                        left = wake - time.monotonic()
                        if left <= 0:
                            break
                        self.cv.wait(left)
                    if self._closed:
                        return
                wake = self.pump()
        finally:
            if self._on_exit is not None:
                try:
                    self._on_exit()
                except Exception:
                    log.exception("WAN emulator engine failed to clean up")


class _Transit:
    """One message on its way along its links, with its leg on each."""
    __slots__ = ("nbytes", "priority", "deliver", "path", "jitter", "seq", "legs")

    def __init__(self, nbytes: int, priority: int, deliver: Callable[[], None], path: tuple, jitter: float,
                 seq: int) -> None:
        self.nbytes, self.priority, self.deliver, self.path, self.jitter, self.seq = (
            nbytes, priority, deliver, path, jitter, seq)
        self.legs = [_Leg(self, hop) for hop in range(len(path))]


class _Leg:
    """A message's bytes on one link: how many are left to serialize, and those that reached it (ready time,
    bytes) and wait for the line."""
    __slots__ = ("transit", "hop", "left", "pieces")

    def __init__(self, transit: _Transit, hop: int) -> None:
        self.transit, self.hop, self.left = transit, hop, transit.nbytes
        self.pieces: collections.deque = collections.deque()


class EmulatedLink:
    """One directed WAN link (or a node's own link); see the module docstring for the model.

    ``engine``: the :class:`LinkEngine` that serializes this link (the link makes and owns one if None);
    ``scheduler``: what calls deliveries at their times (default: the engine; anything with
    ``schedule(at, fn)``). ``epoch``: monotonic time of second 0 of the throughput series (links of one emulator
    share it). ``stage``: where the link sits on a path (NODE_EGRESS ... NODE_INGRESS).
    """

    def __init__(self, *, name: str, rate_bps: float, one_way_delay_s: float, jitter_s: float = 0.0,
                 chunk_bytes: int = 65536, seed: int = 0, scheduler=None, engine: LinkEngine | None = None,
                 epoch: float | None = None, outages: Iterable[tuple] = (), tcp: TcpPath | None = None,
                 stage: int = WAN) -> None:
        if not rate_bps or rate_bps <= 0:
            raise ConfigError(f"link {name}: rate must be > 0 bit/s, got {rate_bps}")
        if one_way_delay_s < 0 or jitter_s < 0:
            raise ConfigError(f"link {name}: delay and jitter must be >= 0, got {one_way_delay_s}, {jitter_s}")
        if chunk_bytes <= 0:
            raise ConfigError(f"link {name}: chunk_bytes must be > 0, got {chunk_bytes}")
        self.name = name
        self.stage = stage
        self.line_rate_bps = float(rate_bps)
        self.one_way_delay_s = float(one_way_delay_s)
        self.rtt_s = 2 * self.one_way_delay_s
        self.tcp = tcp or TcpPath()
        # the rate the line serializes at: its own, or what the TCP streams can move over its RTT
        self.rate_bps = self.tcp.goodput_bps(self.line_rate_bps, self.rtt_s)
        self.jitter_s = float(jitter_s)
        self.chunk_floor = int(chunk_bytes)
        self.chunk_bytes = max(self.chunk_floor, int(self.rate_bps * CHUNK_SECONDS / 8))
        self._rng = random.Random(f"{seed}:{name}")    # str seeds are deterministic across runs
        self._own_engine = engine is None
        self._engine = engine or LinkEngine(name=f"wan-engine-{name}")
        self._scheduler = scheduler or self._engine
        self._epoch = time.monotonic() if epoch is None else epoch
        windows = []
        for start, end, *kept in outages:
            wrong = outage_problem((start, end, *kept))
            if wrong:
                raise ConfigError(f"link {name}: outage {[start, end, *kept]}: {wrong}")
            windows.append((self._epoch + start, self._epoch + end, kept[0] if kept else 0.0))
        self._outages = sorted(windows)          # (start, end, rate kept: 0 cuts the line), monotonic times
        self._constant_rate = not self._outages and not self.tcp.slow_start   # a chunk's time is bytes / rate
        # legs whose next waiting bytes are ready by the line's decision time, by (priority desc, when those bytes
        # reached this link, arrival asc: _requeue), and legs whose next bytes become ready later, by that time; a
        # leg whose bytes are all still upstream is in neither until the previous link hands some on
        self._ready: list = []
        self._later: list = []
        self._seq = itertools.count()
        self._closed = False
        self._busy_until = 0.0              # virtual clock: when the line finishes its last committed chunk
        self._slow_start_at: float | None = None   # when the line last restarted from the initial windows
        self._last_delivery = 0.0
        # counters (queued = enqueued but not yet delivered; after close: dropped), guarded by _stats_lock
        self._stats_lock = threading.Lock()
        self._bytes = 0
        self._messages = 0
        self._series: list[int] = []        # bytes delivered in each second since epoch
        self._queued_bytes = 0
        self._queued_messages = 0
        self._engine.attach(self)

    def enqueue(self, nbytes: int, priority: int, deliver: Callable[[], None], *,
                then: tuple[EmulatedLink, ...] = (), at: float | None = None) -> None:
        """Queue a message of ``nbytes``; ``deliver()`` is called once it has crossed this link and the links
        ``then`` after it, in turn. ``at``: the monotonic time it reached the link (default: now), for a caller
        that sends several messages "at once" or measures from its own clock (a test on a loaded machine would
        otherwise count the wait for the engine's lock as line time)."""
        path = (self, *then)
        if any(link._engine is not self._engine for link in then):
            raise GeomxError(f"link {self.name}: every link of a path must share one engine")
        with self._engine.cv:
            if any(link._closed for link in path):
                raise GeomxError(f"link {self.name} is closed")
            jitter = next((link._jitter() for link in path if link.jitter_s), 0.0)
            transit = _Transit(nbytes, priority, deliver, path, jitter, next(_arrivals))
            for link in path:
                with link._stats_lock:
                    link._queued_bytes += nbytes
                    link._queued_messages += 1
            ready = time.monotonic() if at is None else at
            self._receive(transit.legs[0], ready, nbytes)
            self._engine.kick(self._landing(max(self._busy_until, ready), transit.legs[0]))

    def snapshot(self) -> dict:
        with self._stats_lock:
            return {"name": self.name, "rate_bps": self.rate_bps, "line_rate_bps": self.line_rate_bps,
                    "loss": self.tcp.loss, "streams": self.tcp.streams, "window_bytes": self.tcp.window_bytes,
                    "slow_start": self.tcp.slow_start, "chunk_bytes": self.chunk_bytes,
                    "one_way_delay_s": self.one_way_delay_s,
                    "jitter_s": self.jitter_s, "bytes": self._bytes, "messages": self._messages,
                    "queued_bytes": self._queued_bytes, "queued_messages": self._queued_messages,
                    "series": list(self._series),
                    "outages_s": [[start - self._epoch, end - self._epoch, *([rate] if rate else [])]
                                  for start, end, rate in self._outages]}

    def close(self, timeout: float = 2.0) -> None:
        """Stop serving this link (and its engine, if it owns it); queued messages are dropped."""
        with self._engine.cv:
            self._closed = True
            dropped = len(self._ready) + len(self._later)
            self._ready.clear()
            self._later.clear()
        self._engine.detach(self)
        if dropped:
            log.info("link %s closed with %d message(s) still queued", self.name, dropped)
        if self._own_engine:
            self._engine.close(timeout)

    # -- the model (called with the engine's lock held) -----------------------------------------------------

    def _receive(self, leg: _Leg, ready: float, nbytes: int) -> None:
        """``nbytes`` of ``leg``'s message reached this link at ``ready`` (virtual time)."""
        waiting = bool(leg.pieces)
        leg.pieces.append([ready, nbytes])
        if not waiting and not self._closed:
            heapq.heappush(self._later, (ready, next(self._seq), leg))

    def _commit(self, horizon: float, handed: list) -> float | None:
        """Commit chunks whose line time starts by ``horizon``; deliveries go into ``handed`` as (scheduler, at,
        fn). Returns when the line next has a decision to make (None: nothing it can send yet)."""
        while self._ready or self._later:
            start = self._busy_until
            if not self._ready:
                start = max(start, self._later[0][0])
            start = self._after_outages(start)
            while self._later and self._later[0][0] <= start:
                self._requeue(heapq.heappop(self._later)[2], start)
            if start > horizon or not self._ready:
                return start
            leg = heapq.heappop(self._ready)[1]
            limit = self.chunk_bytes
            if self._constant_rate and leg.hop + 1 == len(leg.transit.path):
                # nothing can take the line before the horizon (or a queued leg's ready time), and no link
                # downstream streams these bytes: what chunk by chunk would commit, as one chunk
                until = min(horizon, self._later[0][0]) if self._later else horizon
                limit = max(limit, int((until - start) * self.rate_bps / 8))
            take = 0
            while leg.pieces and leg.pieces[0][0] <= start and take < limit:
                piece = leg.pieces[0]
                n = min(piece[1], limit - take)
                take += n
                piece[1] -= n
                if not piece[1]:
                    leg.pieces.popleft()
            end = self._serialized(start, take)
            self._busy_until = end
            leg.left -= take
            transit = leg.transit
            arrives = self._after_outages(end + self.one_way_delay_s + (transit.jitter if self.jitter_s else 0.0))
            if leg.hop + 1 < len(transit.path):     # these bytes go on to the next link of the path
                transit.path[leg.hop + 1]._receive(transit.legs[leg.hop + 1], arrives, take)
            if leg.left:
                if leg.pieces:
                    self._requeue(leg, end)
                continue                        # else the previous link hands its next bytes on (and requeues it)
            if leg.hop + 1 == len(transit.path):
                at = max(arrives, self._last_delivery)
                self._last_delivery = at
                handed.append((self._scheduler, at, lambda t=transit, a=at: self._delivered(t, a)))
        return None

    def _landing_floor(self) -> float:
        """No message queued here lands before this: it needs the line after ``busy_until``, then the delay."""
        return self._busy_until + self.one_way_delay_s - 2 * self.jitter_s

    def _soonest_landing(self) -> float:
        """A lower bound on when any message queued here can have crossed this line and its delay: its bytes
        need the line for at least ``left`` at the full rate, from when the line is free or they are ready.
        Until then only an arrival can change what the line does, and an arrival tells the engine its own."""
        busy = self._busy_until
        if self._ready and not self._later:
            head = self._ready[0][1]
            if len(head.pieces) == 1 and head.pieces[0][1] == head.left:
                # all its bytes are here, ready by one time: its place in the queue stays first until it is sent,
                # so nothing queued here lands before it (the common case, and no need to look at every leg)
                return self._landing(busy, head)
        return min(min((self._landing(busy, leg) for _, leg in self._ready), default=float("inf")),
                   min((self._landing(max(busy, at), leg) for at, _, leg in self._later), default=float("inf")))

    def _landing(self, start: float, leg: _Leg) -> float:
        """The soonest ``leg`` can have crossed this line and its delay if its bytes take the line from ``start``."""
        return (start + leg.left * 8.0 / self.rate_bps + self.one_way_delay_s
                + (leg.transit.jitter if self.jitter_s else 0.0))

    def _requeue(self, leg: _Leg, now: float) -> None:
        """Queue ``leg`` by its waiting bytes: among those ready by ``now``, by (priority desc, the time its next
        bytes reached this link, arrival): a line shared by several links' flows (a node's) takes their chunks in
        the order they came, as a switch port does, and a link's own messages stay FIFO."""
        head = leg.pieces[0][0]
        if head <= now:
            heapq.heappush(self._ready, ((-leg.transit.priority, head, leg.transit.seq), leg))
        else:
            heapq.heappush(self._later, (head, next(self._seq), leg))

    def _serialized(self, start: float, nbytes: int) -> float:
        """When ``nbytes`` that start on the line at ``start`` have left it."""
        rate = self._rate_at(start)
        bits = nbytes * 8.0
        if not self.tcp.slow_start or self.rtt_s <= 0:
            return start + bits / rate
        if self._slow_start_at is None or start - self._busy_until > self.tcp.retransmit_timeout_s(self.rtt_s):
            self._slow_start_at = start         # idle past the timeout (or new): back to the initial windows
        return self._slow_start_at + self.tcp.slow_start_elapsed(start - self._slow_start_at, bits, rate, self.rtt_s)

    def _jitter(self) -> float:
        j = self._rng.gauss(0.0, self.jitter_s)
        return max(-2 * self.jitter_s, min(2 * self.jitter_s, j))

    def _after_outages(self, t: float) -> float:
        """``t``, or the end of the cut it falls in."""
        for start, end, rate in self._outages:
            if not rate and start <= t < end:
                t = end
        return t

    def _rate_at(self, t: float) -> float:
        """The line's rate at ``t``: the lowest a slowing window then leaves it, else its own."""
        if not self._outages:
            return self.rate_bps
        return min([self.rate_bps, *(rate for start, end, rate in self._outages if rate and start <= t < end)])

    def _delivered(self, transit: _Transit, at: float) -> None:
        # a transit and its legs point at each other: untie them, so that reference counting frees the message
        # here and the garbage collector has nothing to chase (it cost the emulator ~10% of its CPU at 64 KiB)
        transit.legs = ()
        for link in transit.path:
            with link._stats_lock:
                link._queued_bytes -= transit.nbytes
                link._queued_messages -= 1
        # counted before it is handed on, so that whatever a receiver holds is already counted (a reader of the
        # stats never sees a delivered message missing); in the second the model delivers it, not when a busy
        # host got round to it: the series is the link's, and a delivery made 20 ms late must not land in the
        # second of an outage that began meanwhile
        for link in transit.path:
            link._count(transit.nbytes, at)
        try:
            transit.deliver()
        except BaseException:       # forwarding failed: the message was not delivered, so not counted
            for link in transit.path:
                link._count(-transit.nbytes, at, messages=-1)
            raise

    def _count(self, nbytes: int, at: float, *, messages: int = 1) -> None:
        second = max(0, int(at - self._epoch))
        with self._stats_lock:
            self._bytes += nbytes
            self._messages += messages
            if second >= len(self._series):
                self._series.extend([0] * (second + 1 - len(self._series)))
            self._series[second] += nbytes

