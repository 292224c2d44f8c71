"""In what order a step's gradients cross a congested link: the priorities FSA and P3 push them with.

Backward makes the last layers' gradients first. The links honour priorities strictly (the van's queue, the
emulator's chunks): a message overtakes every lower one still waiting, even one half sent. So if each new
gradient outranks the ones before it (priority ``-index``, first layers first, which GeoMX and P3 give every
push), each overtakes the ones already on the wire. Nothing finishes its upload while backward runs, no reply
comes back meanwhile, and the downlink idles until backward ends. Then the whole model comes down after it.
(The emulator lets a message overtake at its next 64 KiB chunk, more finely than a real TCP stream, which sends
what its socket holds in order; over a real WAN the overtaking happens in the van's queue, behind ZeroMQ's pipe
of 16 messages, so the same holds for what waits there.)

* FSA waits for every reply before the next forward pass, so the order replies come in buys it nothing. Its
  gradients go in the order backward makes them (:func:`backward_order`: the last layers highest). Each upload
  finishes in turn and its reply comes down during backward. A parameter has the same priority in every worker,
  so where several workers share a link (the flat PS's) the same gradient of each crosses together and the
  server answers it while the next ones travel; one priority for all would send them in the order they
  reached the link, one worker's whole model first (that made the flat PS's step 1.19 s instead of 0.94, tiny
  compute over ``transpacific``). Measured on the tiny LM over a link where a step's upload takes about twice
  its backward pass, FSA's step fell from 1.26 to 1.00 s (docs/benchmarks.md, "Gradients in the order backward
  makes them").
* P3 wants the first layers' replies first, once backward has ended, because the next forward pass needs them
  first. It also wants the uplink to finish whole uploads during backward. :class:`TailFirst` does both. The
  last layers, about as many bytes as the uplink carries during a backward pass, go in the order backward
  makes them. The other layers go after them, first layers first. The share of the tail is measured every step
  from the pace the previous step's replies came in, each part of a parameter counted as it lands (a big
  parameter's parts land over a long time, most maybe during backward). A layer too big for the margin's hedge
  ends the tail (:func:`tail_first_priorities`): on a VGG-shaped model (compute in the convolutions, bytes in the
  first fully connected layer) that lets the convolutions' few bytes cross first once backward makes them, and
  their forward pass, most of the step's, run while the big layer still travels.

Every gradient's priority is below 0, the default of control messages (heartbeats go at 1000).
"""
from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Sequence

from geomx.errors import ConfigError

# the tail is sized a quarter above the measured estimate: too large a tail only delays the first layers behind
# its last uploads (the order tends to FSA's), too small a one leaves the downlink idle (P3's old order). The
# estimate also moves halfway to each new step's figure, so one odd step cannot swing it.
TAIL_MARGIN = 1.25
SMOOTHING = 0.5
MIN_LANDINGS = 3           # replies after backward ended needed to read the link's pace from
CUT_STEPS = 16             # the tail is cut at a multiple of 1/16 of the bytes


def backward_order(count: int) -> list[int]:
    """FSA's priority of each of ``count`` parameters: the last highest, as backward makes them (-1 down to
    -count)."""
    return [i - count for i in range(count)]


def tail_first_priorities(sizes: Sequence[int], tail_fraction: float) -> list[int]:
    """P3's priority of each parameter: the last parameters holding at most ``tail_fraction`` of the bytes keep
    :func:`backward_order`'s; every other one goes below them all, first layers first.

    ``tail_fraction`` holds :data:`TAIL_MARGIN`'s hedge: the estimate times the margin. The hedge adds the few
    layers an estimate that runs low would have left out. A parameter bigger than the hedge itself that ends past
    the estimate is not one of those: in the tail its upload would outlast backward by more than the hedge
    covers, and every first layer would wait behind it. So the tail ends before it (VGG's first fully connected
    layer, 81% of the bytes). At the bottom of the rest it still fills the uplink whenever nothing else waits, in
    parts that land one by one. A whole tail (1.0) is FSA's order, whatever the sizes."""
    count, total = len(sizes), sum(sizes)
    in_backward_order = backward_order(count)
    if tail_fraction >= 1.0:
        return in_backward_order
    priorities = [-count - 1 - i for i in range(count)]
    estimate = tail_fraction / TAIL_MARGIN
    hedge = tail_fraction - estimate
    in_tail = 0
    for i in range(count - 1, -1, -1):
        in_tail += sizes[i]
        if in_tail > tail_fraction * total:
            break
        if in_tail > estimate * total and sizes[i] > hedge * total:
            break
        priorities[i] = in_backward_order[i]
    return priorities


def uploadable_share(*, backward_s: float, landings: Sequence[tuple[float, int]], total_bytes: int) -> float:
    """The share of a step's bytes the uplink can carry during a backward pass of ``backward_s`` seconds.

    ``landings``: (time, bytes) of the step's replies that landed after its backward pass ended, in time order.
    Those wait for the link one behind the other, so their pace is the link's rate. Fewer than
    :data:`MIN_LANDINGS` of them means the link kept up with backward: it carries everything (1.0)."""
    if len(landings) < MIN_LANDINGS or total_bytes <= 0:
        return 1.0
    span = landings[-1][0] - landings[0][0]
    if span <= 0:
        return 1.0
    rate = sum(nbytes for _, nbytes in landings[1:]) / span
    return min(1.0, rate * backward_s / total_bytes)


def check_tail_fraction(value) -> float:
    """A saved tail share, checked: a real number in [0, 1] (not a bool, not a string)."""
    share = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"p3 state: tail_fraction must be a share of the bytes in [0, 1], got {value!r}")
    return share


class TailFirst:
    """P3's order (see the module docstring), its state a step's timings and the tail's share of the bytes.

    Call :meth:`begin_push` at each push (it returns the priority), :meth:`landed` when a reply lands, and
    :meth:`end_backward` when the step's last gradient is on its way. ``sizes``: each parameter's bytes, 0 for
    one that is never pushed (frozen). The tail's share starts at 1.0 (every gradient in the order backward makes
    it, FSA's order) and follows the estimate from the second step on. Each worker measures its own; the cut
    between tail and rest moves in sixteenths of the bytes, so that workers whose estimates differ a little (the
    same links, other timings) still cut alike and a parameter keeps one priority across them."""

    def __init__(self, sizes: Sequence[int], *, tail_fraction: float = 1.0) -> None:
        self.sizes = [int(s) for s in sizes]
        self.tail_fraction = check_tail_fraction(tail_fraction)
        self._priorities = tail_first_priorities(self.sizes, _cut(self.tail_fraction))
        self._below_tail = tail_first_priorities(self.sizes, 0.0)
        self._pushing = False                       # this step's first push was made
        self._first_push: float | None = None       # this step's first push from backward
        self._backward_end: float | None = None     # the previous step's end of backward
        self._backward_s: float | None = None       # its length (None: no gradient came from backward)
        self._landed: list[tuple[float, float]] = []  # the previous step's replies: (time, bytes)
        self._lock = threading.Lock()               # landed() runs on the receive thread

    def begin_push(self, i: int, now: float, *, from_backward: bool = True) -> int:
        """Parameter ``i``'s priority. ``from_backward`` False: pushed by ``step()`` (no gradient this step), after
        backward, so below the tail whatever its place, as every push made then."""
        if not self._pushing:                     # the step's first push: the previous step's replies are in
            self._pushing = True
            self._update()
        if not from_backward:
            return self._below_tail[i]
        if self._first_push is None:
            self._first_push = now
        return self._priorities[i]

    def landed(self, i: int, now: float, *, share: float = 1.0) -> None:
        """A reply of parameter ``i`` landed: the whole of it, or a part holding ``share`` of its elements. Called
        from the receive thread."""
        with self._lock:
            self._landed.append((now, self.sizes[i] * share))

    def end_backward(self, now: float) -> None:
        self._backward_s = None if self._first_push is None else now - self._first_push
        self._backward_end, self._first_push, self._pushing = now, None, False

    def _update(self) -> None:
        with self._lock:
            landed, self._landed = self._landed, []
        if self._backward_end is None or self._backward_s is None:    # the first step, or one without backward
            return
        after = sorted((t, nbytes) for t, nbytes in landed if t > self._backward_end)
        share = uploadable_share(backward_s=self._backward_s, landings=after, total_bytes=sum(self.sizes))
        target = min(1.0, TAIL_MARGIN * share)
        self.tail_fraction += SMOOTHING * (target - self.tail_fraction)
        self._priorities = tail_first_priorities(self.sizes, _cut(self.tail_fraction))


def _cut(tail_fraction: float) -> float:
    return round(tail_fraction * CUT_STEPS) / CUT_STEPS
