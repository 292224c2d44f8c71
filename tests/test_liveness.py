"""Measured heartbeat deadlines, the default (issue 16, no timeout tuning): a scheduler measures how long each
member may be silent from the gaps between its heartbeats (geomx.cluster.liveness.MeasuredDeadline) instead of a
fixed 10 s, and gives a member whose process is seen to run (busy, not frozen) the full 10 s."""
from __future__ import annotations

import time

import pytest

from geomx.cluster.liveness import FLOOR_S, MIN_GAPS, MeasuredDeadline


def heartbeats(deadline: MeasuredDeadline, gaps: list[float], member: str = "m") -> None:
    now = 0.0
    deadline.heard(member, now)
    for gap in gaps:
        now += gap
        deadline.heard(member, now)


def test_steady_heartbeats_give_a_deadline_at_the_floor_and_the_cap_holds_until_enough_were_measured():
    d = MeasuredDeadline(10.0)
    heartbeats(d, [0.25] * (MIN_GAPS - 1))
    assert d.deadline("m") == 10.0 and d.deadline("never-heard") == 10.0
    heartbeats(d, [0.25, 0.26, 0.24] * 10)
    assert d.deadline("m") == pytest.approx(FLOOR_S)


def test_uneven_heartbeats_get_more_time_and_never_more_than_the_fixed_timeout():
    d = MeasuredDeadline(10.0)
    # every fifth heartbeat waited 1.6 s behind a gradient on a slow link: 1.5 x the longest gap
    heartbeats(d, [0.25, 0.25, 0.25, 0.25, 1.6] * 8)
    assert d.deadline("m") == pytest.approx(2.4)
    heartbeats(d, [0.25] * 8 + [30.0], member="slow")
    assert d.deadline("slow") == 10.0
    assert d.deadline("m", running=True) == 10.0        # its ZeroMQ answers: busy, not gone


BUSY_SCRIPT = """
import ctypes
import time
import numpy as np
import geomx

kv = geomx.kvstore.create(reduction="mean")
kv.init("w", np.zeros(10, np.float32))
if not kv.is_master_worker:
    started = time.monotonic()
    for step in range(80):
        if step == 40 and kv.rank == 1:
            print(f"busy after {time.monotonic() - started:.1f} s", flush=True)   # its deadline measured by then
            # libc's sleep called holding Python's lock: no thread of this process runs Python for 5 s, its
            # heartbeats included; its ZeroMQ threads still answer
            ctypes.PyDLL(None).sleep(5)
        assert (kv.pushpull("w", np.ones(10, np.float32)).wait() == 1).all()
        time.sleep(0.1)
    print("done", kv.rank, flush=True)
"""


def test_a_worker_too_busy_to_heartbeat_for_5_s_is_not_dropped_because_its_zeromq_still_answers(tmp_path):
    """A worker stuck 5 s in one call that holds Python's lock sends no heartbeat, far past its measured deadline
    (about 2 s); its DC's scheduler probes its connection, sees its ZeroMQ answer, and gives it the full 10 s:
    both workers take every round together and nobody is dropped."""
    from harness import check_ok, launch

    code, run_dir, output = launch(tmp_path, BUSY_SCRIPT, dcs=1, workers_per_dc=2, timeout=90)
    check_ok((code, run_dir, output))
    assert "done 0" in output and "done 1" in output, output
    assert not (run_dir / "dropped.jsonl").exists() or not (run_dir / "dropped.jsonl").read_text(), output


def test_a_worker_whose_heartbeats_stop_is_dropped_within_about_two_seconds_with_measured_deadlines():
    import numpy as np

    from inproc import HipsCluster

    from geomx.cluster.scheduler import CHECK_S
    from harness import wait_until
    from inproc import DEADLINE_S

    # the in-memory van has no connections to watch: the heartbeats alone give the silent worker away
    cluster = HipsCluster(dcs=("a", "b"), per_dc=2, heartbeat_interval=0.1, measured_liveness=True)
    try:
        cluster.init_everywhere("w", np.zeros(4, np.float32))
        a1, liveness = cluster.workers["a"][1], cluster.schedulers["dc:a"].liveness
        member = a1.po.node_id
        # enough gaps measured (waited on, not slept: on a loaded machine 0.1 s heartbeats come later)
        wait_until(lambda: len(liveness._gaps.get(member, ())) >= MIN_GAPS, DEADLINE_S, "measured gaps")
        stopped = time.monotonic()
        a1.po._hb_stop.set()                    # a frozen heartbeat thread (before MIN_GAPS gaps: 60 s)
        local = cluster.local["a"]
        while len(local.dc_tier.workers()) == 2 and time.monotonic() - stopped < 30:
            time.sleep(0.02)
        after, deadline = time.monotonic() - stopped, liveness.deadline(member)
        print(f"dropped {after:.2f} s after its last heartbeat (its measured deadline {deadline:.2f} s)")
        assert len(local.dc_tier.workers()) == 1, after
        # measured, not the 60 s cap (about 2 s on an idle machine; more where heartbeats came unevenly), and
        # acted on within a check or two of it
        assert FLOOR_S <= deadline < 10.0 and after < deadline + 2 * CHECK_S + 0.5, (after, deadline)
    finally:
        cluster.close()
