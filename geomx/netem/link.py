"""One emulated WAN link (a directed DC pair) and the thread that delivers its messages.

The model of a link is one serial line of ``rate_bps`` followed by a propagation delay:

* Messages wait in a queue ordered by (priority desc, arrival asc). A scheduler thread serializes the message
  at the head of the queue one chunk (``chunk_bytes``) at a time, so a higher-priority message that arrives
  while a bulk message is half sent overtakes it at the next chunk boundary; equal priorities stay FIFO.
* Serialization runs on a virtual clock: a chunk occupies the line from ``max(busy_until, arrival)`` for
  ``chunk * 8 / rate_bps`` seconds (``arrival``: when its message was enqueued). The thread sleeps only
  while the virtual clock is more than ``LOOKAHEAD_S`` ahead of real time, and a thread that wakes late
  (coarse sleeps, a busy machine) back-dates the chunks it commits instead of leaving the line idle, so
  goodput stays at the rate and deliveries keep their virtual times (a late one is made at once). The choice
  of the next chunk is made at most ``LOOKAHEAD_S`` before that chunk starts.
* A message whose last chunk ends at ``tx_end`` is delivered at ``tx_end + one_way_delay + jitter``, jitter
  drawn from a seeded normal distribution (std ``jitter_s``, clipped to +-2 std), but never before the
  previous delivery on the same link: a TCP connection does not reorder.
* Deliveries are made by a :class:`DeliveryScheduler`: one time-ordered heap and one thread that may be
  shared by every link of an emulator; it calls each message's ``deliver()`` at its time.

* Outages (``outages``: (start, end) in seconds since ``epoch``) model a partition that heals: the line
  carries nothing while one lasts, and a delivery that would fall inside one is made when it ends (what was on
  the wire is retransmitted once the path is back, as TCP does for a partition shorter than its timeouts).
  (start, end, rate) slows the line instead: a chunk that starts in that window is serialized at that rate.

* ``tcp`` (a :class:`geomx.netem.tcp_model.TcpPath`): loss and the streams' window cap the line's rate at what
  that many TCP streams move over the link's RTT; the line then serializes at that goodput.

Not modelled: the time course of congestion control (slow start, the sawtooth), retransmitted bytes, per-packet
header overhead.
"""
from __future__ import annotations

import functools
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

LOOKAHEAD_S = 0.002     # how far the virtual clock may run ahead of real time before the scheduler sleeps
_IDLE_WAIT_S = 0.5      # every wait has a timeout, so a lost notify or a close is noticed


class DeliveryScheduler:
    """Calls ``fn()`` at monotonic time ``at`` for every ``schedule(at, fn)``, in (time, arrival) order.

    One daemon thread runs all callbacks, so a callback may use sockets that only this thread owns;
    ``on_exit`` runs in that thread when it stops (the place to close those sockets).
    """

    def __init__(self, *, name: str = "wan-delivery", on_exit: Callable[[], None] | None = None) -> None:
        self._heap: list = []
        self._seq = itertools.count()       # ties on time keep arrival order
        self._cv = threading.Condition()
        self._closed = False
        self._on_exit = on_exit
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def schedule(self, at: float, fn: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (at, next(self._seq), fn))
            if self._heap[0][2] is fn:      # new earliest deadline: wake the thread to re-arm its wait
                self._cv.notify()

    @property
    def pending(self) -> int:
        return len(self._heap)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread; deliveries not yet due are dropped."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while True:
                        if self._closed:
                            return
                        wait = self._heap[0][0] - time.monotonic() if self._heap else _IDLE_WAIT_S
                        if wait <= 0:
                            break
                        self._cv.wait(min(wait, _IDLE_WAIT_S))
                    _, _, fn = heapq.heappop(self._heap)
                try:
                    fn()
                except Exception:   # one bad delivery must not stop all links
                    log.exception("WAN emulator failed to deliver a message")
        finally:
            if self._on_exit is not None:
                try:
                    self._on_exit()
                except Exception:
                    log.exception("WAN emulator delivery thread failed to clean up")


class EmulatedLink:
    """One directed WAN link; see the module docstring for the model.

    ``scheduler``: the :class:`DeliveryScheduler` that performs deliveries (the link makes and owns one if
    None). ``epoch``: monotonic time of second 0 of the throughput series (links of one emulator share it).
    """

    def __init__(self, *, name: str, rate_bps: float, one_way_delay_s: float, jitter_s: float = 0.0,
                 chunk_bytes: int = 65536, seed: int = 0, scheduler: DeliveryScheduler | None = None,
                 epoch: float | None = None, outages: Iterable[tuple] = (), tcp: TcpPath | None = None) -> None:
        if not rate_bps or rate_bps <= 0:
            raise ConfigError(f"link {name}: rate must be > 0 bit/s, got {rate_bps}")
        if one_way_delay_s < 0 or jitter_s < 0:
            raise ConfigError(f"link {name}: delay and jitter must be >= 0, got {one_way_delay_s}, {jitter_s}")
        if chunk_bytes <= 0:
            raise ConfigError(f"link {name}: chunk_bytes must be > 0, got {chunk_bytes}")
        self.name = name
        self.line_rate_bps = float(rate_bps)
        self.one_way_delay_s = float(one_way_delay_s)
        self.tcp = tcp or TcpPath()
        # the rate the line serializes at: its own, or what the TCP streams can move over its RTT
        self.rate_bps = self.tcp.goodput_bps(self.line_rate_bps, 2 * self.one_way_delay_s)
        self.jitter_s = float(jitter_s)
        self.chunk_bytes = int(chunk_bytes)
        self._rng = random.Random(f"{seed}:{name}")    # str seeds are deterministic across runs
        self._own_scheduler = scheduler is None
        self._scheduler = scheduler or DeliveryScheduler(name=f"wan-delivery-{name}")
        self._epoch = time.monotonic() if epoch is None else epoch
        windows = []
        for start, end, *kept in outages:
            wrong = outage_problem((start, end, *kept))
            if wrong:
                raise ConfigError(f"link {name}: outage {[start, end, *kept]}: {wrong}")
            windows.append((self._epoch + start, self._epoch + end, kept[0] if kept else 0.0))
        self._outages = sorted(windows)          # (start, end, rate kept: 0 cuts the line), monotonic times
        self._queue: list = []              # heap of [-priority, seq, remaining bytes, nbytes, deliver, arrival]
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._busy_until = 0.0              # virtual clock: when the line finishes its last committed chunk
        self._last_delivery = 0.0
        # counters (queued = enqueued but not yet delivered; after close: dropped), guarded by _stats_lock
        self._stats_lock = threading.Lock()
        self._bytes = 0
        self._messages = 0
        self._series: list[int] = []        # bytes delivered in each second since epoch
        self._queued_bytes = 0
        self._queued_messages = 0
        self._thread = threading.Thread(target=self._run, name=f"wan-link-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, nbytes: int, priority: int, deliver: Callable[[], None]) -> None:
        """Queue a message of ``nbytes``; ``deliver()`` is called once it has crossed the link."""
        with self._cv:
            if self._closed:
                raise GeomxError(f"link {self.name} is closed")
            with self._stats_lock:
                self._queued_bytes += nbytes
                self._queued_messages += 1
            heapq.heappush(self._queue, [-priority, next(self._seq), nbytes, nbytes, deliver, time.monotonic()])
            self._cv.notify()

    def snapshot(self) -> dict:
        with self._stats_lock:
            return {"name": self.name, "rate_bps": self.rate_bps, "line_rate_bps": self.line_rate_bps,
                    "loss": self.tcp.loss, "streams": self.tcp.streams, "window_bytes": self.tcp.window_bytes,
                    "one_way_delay_s": self.one_way_delay_s,
                    "jitter_s": self.jitter_s, "bytes": self._bytes, "messages": self._messages,
                    "queued_bytes": self._queued_bytes, "queued_messages": self._queued_messages,
                    "series": list(self._series),
                    "outages_s": [[start - self._epoch, end - self._epoch, *([rate] if rate else [])]
                                  for start, end, rate in self._outages]}

    def close(self, timeout: float = 2.0) -> None:
        """Stop the scheduler thread (and the delivery thread if the link owns it); queued messages are dropped."""
        with self._cv:
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if dropped:
            log.info("link %s closed with %d message(s) still queued", self.name, dropped)
        self._thread.join(timeout)
        if self._own_scheduler:
            self._scheduler.close(timeout)

    # -- threads -----------------------------------------------------------------------------------------

    def _jitter(self) -> float:
        if not self.jitter_s:
            return 0.0
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
        return min([self.rate_bps, *(rate for start, end, rate in self._outages if rate and start <= t < end)])

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                if not self._queue:
                    self._cv.wait(_IDLE_WAIT_S)
                    continue
                now = time.monotonic()
                ahead = self._busy_until - now
                if ahead > LOOKAHEAD_S:
                    # line busy: sleep until shortly before it frees up (an enqueue may wake us early: harmless)
                    self._cv.wait(ahead - LOOKAHEAD_S)
                    continue
                head = self._queue[0]   # highest priority, oldest first: chosen anew at every chunk boundary
                chunk = min(self.chunk_bytes, head[2])
                start = self._after_outages(max(self._busy_until, head[5]))
                self._busy_until = start + chunk * 8.0 / self._rate_at(start)
                head[2] -= chunk
                if head[2] > 0:
                    continue
                heapq.heappop(self._queue)
                at = self._after_outages(max(self._busy_until + self.one_way_delay_s + self._jitter(),
                                             self._last_delivery))
                self._last_delivery = at
                nbytes, deliver = head[3], head[4]
            # only this thread schedules for this link, so equal times keep FIFO order in the scheduler
            self._scheduler.schedule(at, functools.partial(self._delivered, nbytes, deliver, at))

    def _delivered(self, nbytes: int, deliver: Callable[[], None], at: float) -> None:
        with self._stats_lock:
            self._queued_bytes -= nbytes
            self._queued_messages -= 1
        deliver()   # raises if forwarding failed: then the message is not counted as delivered
        # counted in the second the model delivers it, not when a busy host got round to it: the series is the
        # link's, and a delivery made 20 ms late must not land in the second of an outage that began meanwhile
        second = max(0, int(at - self._epoch))
        with self._stats_lock:
            self._bytes += nbytes
            self._messages += 1
            if second >= len(self._series):
                self._series.extend([0] * (second + 1 - len(self._series)))
            self._series[second] += nbytes
