"""GEOMX_HEARTBEAT_TIMEOUT=auto (issue 16, no timeout tuning): a scheduler measures how long each member may be
silent from the gaps between its heartbeats (geomx.cluster.liveness.MeasuredDeadline) instead of a fixed 10 s."""
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
    # every fifth heartbeat waited 0.6 s behind a gradient on a slow link: 1.5 x the longest gap
    heartbeats(d, [0.25, 0.25, 0.25, 0.25, 0.6] * 8)
    assert d.deadline("m") == pytest.approx(0.9)
    heartbeats(d, [0.25] * 8 + [30.0], member="slow")
    assert d.deadline("slow") == 10.0


def test_a_worker_whose_heartbeats_stop_is_dropped_within_about_a_second_with_measured_deadlines():
    import numpy as np

    from inproc import HipsCluster

    # the in-memory van has no connections to watch: the heartbeats alone give the silent worker away
    cluster = HipsCluster(dcs=("a", "b"), per_dc=2, heartbeat_interval=0.1, measured_liveness=True)
    try:
        cluster.init_everywhere("w", np.zeros(4, np.float32))
        time.sleep(MIN_GAPS * 0.1 + 0.5)        # enough gaps measured
        a1 = cluster.workers["a"][1]
        stopped = time.monotonic()
        a1.po._hb_stop.set()                    # a frozen heartbeat thread (fixed deadline here: 60 s)
        local = cluster.local["a"]
        while len(local.dc_tier.workers()) == 2 and time.monotonic() - stopped < 30:
            time.sleep(0.02)
        after = time.monotonic() - stopped
        print(f"dropped {after:.2f} s after its last heartbeat")
        assert len(local.dc_tier.workers()) == 1 and after < 3.0, after
    finally:
        cluster.close()
