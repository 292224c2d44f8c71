"""The emulator's links in tandem (a node's own line: the in-cast MultiGPS relieves; a DC's own line: what all
its pair links share), slow start after idle, and
one engine driving every link. Delivery times are checked in the model's virtual time (a recorder stands in
for the delivery scheduler), free of the machine's noise; the end-to-end test checks what crossed which line.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from geomx.bench.common import free_port
from geomx.errors import ConfigError
from geomx.netem import EmulatedLink, LinkEngine, WanEmulator, dc_lines, node_links
from geomx.netem.link import DC_EGRESS, NODE_EGRESS, NODE_INGRESS
from geomx.netem.tcp_model import INITIAL_WINDOW_SEGMENTS, MSS_BYTES, TcpPath, tcp_path
from geomx.profiles import CENTRAL_DC, custom_profile
from geomx.transport.message import Message
from geomx.transport.van import ZmqVan


class Recorder:
    """Stands in for the delivery scheduler: records each delivery's virtual time and delivers at once."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.names: list[str] = []

    def schedule(self, at: float, fn) -> None:
        self.times.append(at)
        fn()

    def send_and_wait(self, sends, timeout: float = 10.0) -> dict[str, float]:
        """``sends``: [(link, name, nbytes, then)], enqueued at once; returns name -> its delivery's virtual time
        after the first enqueue."""
        self.times.clear()
        self.names.clear()
        done = threading.Event()

        def deliver(name):
            self.names.append(name)
            if len(self.names) == len(sends):
                done.set()
        t0 = time.monotonic()
        for link, name, nbytes, then in sends:      # all at t0: the lock's wait and preemption are not line time
            link.enqueue(nbytes, 0, lambda n=name: deliver(n), then=then, at=t0)
        assert done.wait(timeout), f"{len(self.names)} of {len(sends)} delivered"
        return {name: at - t0 for name, at in zip(self.names, self.times, strict=True)}


def inboxes(*names: str):
    """(messages received by name, the condition notified on each, inbox(name): a van's on_message)."""
    got: dict[str, list] = {name: [] for name in names}
    cv = threading.Condition()

    def inbox(name):
        def on(msg):
            with cv:
                got[name].append(msg)
                cv.notify_all()
        return on
    return got, cv, inbox


@pytest.fixture
def engine():
    eng = LinkEngine()
    yield eng
    eng.close()


@pytest.fixture
def rec():
    return Recorder()


def wan(engine, rec, dc: str, rate: float = 1e9, one_way: float = 0.01, **kw) -> EmulatedLink:
    return EmulatedLink(name=f"{dc}->central", rate_bps=rate, one_way_delay_s=one_way, engine=engine,
                        scheduler=rec, **kw)


def test_dcs_pushing_into_one_node_link_share_its_rate_and_without_it_each_has_its_own(engine, rec):
    """Four DCs, each on its own 1 Gbit/s link, send 2 MB at once to one node: alone on their links they all
    arrive after 16 ms + 10 ms; through the node's 1 Gbit/s line the last arrives after 4 x 16 ms + 10 ms."""
    links = [wan(engine, rec, dc) for dc in "abcd"]
    nic = EmulatedLink(name="gs0 in", rate_bps=1e9, one_way_delay_s=0.0, engine=engine, scheduler=rec,
                       stage=NODE_INGRESS)
    try:
        alone = rec.send_and_wait([(lk, lk.name, 2_000_000, ()) for lk in links])
        assert max(alone.values()) == pytest.approx(0.016 + 0.010, abs=0.004)
        shared = rec.send_and_wait([(lk, lk.name, 2_000_000, (nic,)) for lk in links])
        assert max(shared.values()) == pytest.approx(4 * 0.016 + 0.010, abs=0.004)
        assert min(shared.values()) >= 0.016 + 0.010 - 1e-3      # the first streams through, one link's time
        assert nic.snapshot()["bytes"] == 4 * 2_000_000 and nic.snapshot()["messages"] == 4
        assert all(lk.snapshot()["bytes"] == 2 * 2_000_000 for lk in links)   # both rounds crossed each WAN link
    finally:
        for lk in (*links, nic):
            lk.close()


def test_a_dcs_line_makes_its_messages_to_other_dcs_share_one_rate(engine, rec):
    """DC a sends 2 MB to each of three DCs at once, over three 1 Gbit/s pair links (10 ms one-way): alone they
    arrive after 16 ms + 10 ms; through a's 1 Gbit/s egress line the last arrives after 3 x 16 ms + 10 ms."""
    pairs = [EmulatedLink(name=f"a->{dc}", rate_bps=1e9, one_way_delay_s=0.01, engine=engine, scheduler=rec)
             for dc in "bcd"]
    uplink = EmulatedLink(name="DC a out", rate_bps=1e9, one_way_delay_s=0.0, engine=engine, scheduler=rec,
                          stage=DC_EGRESS)
    try:
        alone = rec.send_and_wait([(lk, lk.name, 2_000_000, ()) for lk in pairs])
        assert max(alone.values()) == pytest.approx(0.016 + 0.010, abs=0.004)
        shared = rec.send_and_wait([(uplink, lk.name, 2_000_000, (lk,)) for lk in pairs])
        assert max(shared.values()) == pytest.approx(3 * 0.016 + 0.010, abs=0.004)
        assert uplink.snapshot()["bytes"] == 3 * 2_000_000
    finally:
        for lk in (*pairs, uplink):
            lk.close()


def test_a_message_streams_through_tandem_links_chunk_by_chunk_not_store_and_forward(engine, rec):
    """A node's 1 Gbit/s egress line, then a 1 Gbit/s WAN link with 10 ms one-way: 8 MB arrives 64 ms + 10 ms
    after it is sent (pipelined), not 2 x 64 ms + 10 ms (each line waiting for the whole message)."""
    out = EmulatedLink(name="gs0 out", rate_bps=1e9, one_way_delay_s=0.0, engine=engine, scheduler=rec,
                       stage=NODE_EGRESS)
    down = EmulatedLink(name="central->a", rate_bps=1e9, one_way_delay_s=0.01, engine=engine, scheduler=rec)
    try:
        took = rec.send_and_wait([(out, "reply", 8_000_000, (down,))])
        assert took["reply"] == pytest.approx(0.064 + 0.010, abs=0.004)
        assert out.snapshot()["bytes"] == down.snapshot()["bytes"] == 8_000_000
    finally:
        out.close()
        down.close()


def test_links_of_a_path_must_share_one_engine(engine, rec):
    other = LinkEngine()
    a, b = wan(engine, rec, "a"), EmulatedLink(name="x", rate_bps=1e9, one_way_delay_s=0, engine=other)
    try:
        with pytest.raises(Exception, match="share one engine"):
            a.enqueue(10, 0, lambda: None, then=(b,))
    finally:
        a.close()
        b.close()
        other.close()


def slow_start_by_sum(rate: float, rtt: float, streams: int, nbytes: int) -> float:
    """Slow start computed the long way: window doubling per RTT, summed round by round (fluid within a
    round), until ``nbytes`` have left; the model's closed form must agree."""
    r0 = streams * INITIAL_WINDOW_SEGMENTS * MSS_BYTES * 8 / rtt
    t, left, dt = 0.0, nbytes * 8.0, rtt / 2000
    while left > 0:
        r = min(rate, r0 * 2 ** (t / rtt))
        left -= r * dt
        t += dt
    return t


@pytest.mark.parametrize("streams", [1, 8])
def test_slow_start_after_idle_matches_the_doubling_window_and_only_after_the_timeout(engine, rec, streams):
    """100 Mbit/s, 180 ms RTT, 4 MB (enough for the windows to grow to the line's rate): from the initial windows
    the first message takes what doubling windows give; one sent right after it arrived finds the line at full
    rate; one sent after the line idled past the retransmission timeout (RTT + 200 ms) starts from the initial
    windows again."""
    rate, rtt, size = 100e6, 0.18, 4_000_000
    tcp = tcp_path(streams=streams, slow_start=1)
    link = wan(engine, rec, "b", rate=rate, one_way=rtt / 2, tcp=tcp)
    expected = slow_start_by_sum(rate, rtt, streams, size)
    assert tcp.slow_start_elapsed(0.0, size * 8, rate, rtt) == pytest.approx(expected, rel=0.01)
    assert expected > size * 8 / rate + rtt     # slow start costs more than an RTT at this size
    try:
        first = rec.send_and_wait([(link, "first", size, ())])["first"] - rtt / 2
        assert first == pytest.approx(expected, abs=0.003)
        second = rec.send_and_wait([(link, "second", size, ())])["second"] - rtt / 2
        assert second == pytest.approx(size * 8 / rate, abs=0.01)       # sent within the timeout: full rate
        time.sleep(TcpPath.retransmit_timeout_s(rtt) + 0.05)
        third = rec.send_and_wait([(link, "third", size, ())])["third"] - rtt / 2
        assert third == pytest.approx(expected, abs=0.003)
    finally:
        link.close()


def test_slow_start_is_off_by_default_and_named_when_its_setting_is_wrong():
    assert not TcpPath().slow_start and not TcpPath().limits and TcpPath(slow_start=True).limits
    assert tcp_path(slow_start="1").to_env() == {"GEOMX_WAN_SLOW_START": "1"}
    with pytest.raises(ConfigError, match="GEOMX_WAN_SLOW_START='maybe'"):
        tcp_path(slow_start="maybe")


def test_the_node_link_variable_round_trips_and_names_bad_entries():
    links = {"tcp://127.0.0.1:7001": 1e9, "tcp://10.0.0.2:7002": 2.5e8}
    assert node_links.parse(node_links.to_env(links)) == links
    assert node_links.parse("127.0.0.1:7001=1gbit") == {"tcp://127.0.0.1:7001": 1e9}
    for text, named in [("127.0.0.1=1gbit", "is not HOST:PORT=RATE"), ("127.0.0.1:7001", "is not HOST:PORT=RATE"),
                        ("127.0.0.1:99999=1gbit", "is not HOST:PORT=RATE"),
                        ("127.0.0.1:7001=fast", "127.0.0.1:7001=fast")]:
        with pytest.raises(ConfigError, match=named) as exc:
            node_links.parse(text)
        assert node_links.ENV in str(exc.value)


def test_the_dc_line_variable_round_trips_and_names_bad_entries_and_unknown_dcs():
    lines = {"a": (1e9, 1e9), "b": (5e7, 2.5e8)}
    assert dc_lines.parse(dc_lines.to_env(lines)) == lines
    assert dc_lines.parse("a=1gbit, b=100mbit/1gbit") == {"a": (1e9, 1e9), "b": (1e8, 1e9)}
    for text, named in [("a", "is not DC=RATE"), ("=1gbit", "is not DC=RATE"), ("a=fast", "a=fast"),
                        ("a=0", "must be a finite number > 0"), ("a=1gbit/0", "must be a finite number > 0"),
                        ("a=1/2/3gbit", "is not DC=RATE")]:
        with pytest.raises(ConfigError, match=named) as exc:
            dc_lines.parse(text)
        assert dc_lines.ENV in str(exc.value)
    with pytest.raises(ConfigError, match="GEOMX_WAN_DC_LINES: DC line.*for x, which is no DC"):
        WanEmulator(profile=custom_profile(1e9, 0.002), dcs=["central", "a"], dc_lines={"x": 1e9})


def test_through_the_emulator_a_dcs_messages_to_every_other_dc_cross_its_line():
    """DC a with a line of its own: its messages to b and to the central party both cross it (one egress line,
    two pair links), and what it receives crosses its ingress line; DC b has none."""
    got, cv, inbox = inboxes("a", "b", "c")
    em = WanEmulator(profile=custom_profile(1e9, 0.002), dc_lines={"a": (5e8, 4e8)})     # up, down
    em.start()
    a = ZmqVan(node_id="a", dc="a", on_message=inbox("a"), emulator=em.address)
    b = ZmqVan(node_id="b", dc="b", on_message=inbox("b"), emulator=em.address)
    c = ZmqVan(node_id="c", dc=CENTRAL_DC, on_message=inbox("c"), emulator=em.address)
    try:
        for van in (a, b, c):
            van.start()
        payload = np.zeros(250_000, dtype=np.uint8)
        a.send(b.address, Message("push", tensors=[payload]), dst_dc="b")
        a.send(c.address, Message("push", tensors=[payload]), dst_dc=CENTRAL_DC)
        b.send(a.address, Message("reply", tensors=[payload]), dst_dc="a")
        with cv:
            assert cv.wait_for(lambda: all(len(v) == 1 for v in got.values()), 10.0), got
        stats = em.stats()
        lines = stats["dc_lines"]
        assert set(lines) == {"DC a out", "DC a in"} and lines["DC a out"]["rate_bps"] == 5e8
        assert lines["DC a in"]["rate_bps"] == 4e8
        assert lines["DC a out"]["messages"] == 2 and lines["DC a in"]["messages"] == 1
        assert lines["DC a out"]["bytes"] == stats["links"]["a->b"]["bytes"] + stats["links"]["a->central"]["bytes"]
        assert lines["DC a in"]["bytes"] == stats["links"]["b->a"]["bytes"]
    finally:
        for van in (a, b, c):
            van.stop(flush_timeout=0.5)
        em.stop()


def test_wan_dc_lines_give_the_emulator_each_dcs_line_at_its_links_rate(tmp_path):
    from geomx.cli.launch import plan
    from geomx.cli.topology import load_topology

    topo = load_topology(None, dcs=2, wan="regional", wan_dc_lines=True, wan_links=["b=100mbit/50ms"])
    emulator = next(s for s in plan(topo, ["x"], tmp_path, ports=list(range(21000, 21005))) if s.kind == "emulator")
    assert dc_lines.parse(emulator.env[dc_lines.ENV]) == {"a": (1e9, 1e9), "b": (1e8, 1e8)}
    # an asymmetric profile keeps its downlink (the line had been its uplink's rate both ways: found by a review)
    volunteer = load_topology(None, dcs=2, wan="volunteer", wan_dc_lines=True)
    specs = plan(volunteer, ["x"], tmp_path, ports=list(range(21000, 21005)))
    emulator = next(s for s in specs if s.kind == "emulator")
    up, down = volunteer.profile.rate_for("a", "central"), volunteer.profile.rate_for("central", "a")
    assert up < down and dc_lines.parse(emulator.env[dc_lines.ENV]) == {"a": (up, down), "b": (up, down)}
    plain = plan(load_topology(None, dcs=2, wan="regional"), ["x"], tmp_path, ports=list(range(21000, 21005)))
    assert not next(s for s in plain if s.kind == "emulator").env[dc_lines.ENV]      # written empty: unset
    with pytest.raises(ConfigError, match="--wan-dc-lines.*needs an emulated WAN"):
        load_topology(None, wan="lan", wan_dc_lines=True)


def test_through_the_emulator_a_node_with_a_line_receives_and_sends_across_it():
    """A global server's van at an address with a node link: a DC's push crosses a->central and the node's
    ingress line, the reply the node's egress line and central->a; a node without one crosses only the WAN."""
    got, cv, inbox = inboxes("gs", "other", "a")
    # a port below the kernel's ephemeral range, as geomx launch picks them: a port found free by binding to port
    # 0 and let go was once taken by another process's connection before the van bound it again
    gs_port = free_port()
    em = WanEmulator(profile=custom_profile(1e9, 0.002), node_links={f"tcp://127.0.0.1:{gs_port}": 1e8})
    em.start()
    gs = ZmqVan(node_id="gs", dc=CENTRAL_DC, on_message=inbox("gs"), emulator=em.address, port=gs_port)
    other = ZmqVan(node_id="other", dc=CENTRAL_DC, on_message=inbox("other"), emulator=em.address)
    a = ZmqVan(node_id="a", dc="a", on_message=inbox("a"), emulator=em.address)
    try:
        for van in (gs, other, a):
            van.start()
        payload = np.zeros(250_000, dtype=np.uint8)
        a.send(gs.address, Message("push", tensors=[payload]), dst_dc=CENTRAL_DC)
        a.send(other.address, Message("push", tensors=[payload]), dst_dc=CENTRAL_DC)
        gs.send(a.address, Message("reply", tensors=[payload]), dst_dc="a")
        with cv:
            assert cv.wait_for(lambda: all(len(v) == 1 for v in got.values()), 10.0), got
        stats = em.stats()
        lines = stats["node_links"]
        name = f"127.0.0.1:{gs_port}"
        assert set(lines) == {f"{name} in", f"{name} out"}
        assert lines[f"{name} in"]["messages"] == 1 and lines[f"{name} in"]["direction"] == "in"
        assert lines[f"{name} out"]["messages"] == 1 and lines[f"{name} out"]["rate_bps"] == 1e8
        assert stats["links"]["a->central"]["messages"] == 2 and stats["links"]["central->a"]["messages"] == 1
        assert 2 * lines[f"{name} in"]["bytes"] == stats["links"]["a->central"]["bytes"]   # two equal pushes
        assert lines[f"{name} out"]["bytes"] == stats["links"]["central->a"]["bytes"]
    finally:
        for van in (gs, other, a):
            van.stop(flush_timeout=0.5)
        em.stop()


def test_global_server_link_gives_each_global_server_a_fixed_port_and_the_emulator_its_line(tmp_path):
    from geomx.cli.launch import plan
    from geomx.cli.topology import load_topology

    topo = load_topology(None, dcs=3, global_servers=2, wan="regional", global_server_link="1gbit",
                         wan_slow_start=True)
    assert topo.global_server_link_bps == 1e9 and topo.fixed_ports == 3 + 3 + 2 and topo.tcp.slow_start
    specs = plan(topo, ["python", "train.py"], tmp_path, ports=list(range(21000, 21008)))
    emulator = next(s for s in specs if s.kind == "emulator")
    servers = [s for s in specs if s.name.startswith("global-server-")]
    assert [s.env["PORT"] for s in servers] == ["21006", "21007"] and all(s.pinned for s in servers)
    assert node_links.parse(emulator.env[node_links.ENV]) == {"tcp://127.0.0.1:21006": 1e9,
                                                              "tcp://127.0.0.1:21007": 1e9}
    assert emulator.env["GEOMX_WAN_SLOW_START"] == "1"
    plain = plan(load_topology(None, dcs=3, global_servers=2, wan="regional"), ["x"], tmp_path,
                 ports=list(range(21000, 21006)))
    assert not next(s for s in plain if s.kind == "emulator").env[node_links.ENV]    # written empty: unset
    assert all("PORT" not in s.env for s in plain if s.name.startswith("global-server-"))
    with pytest.raises(ConfigError, match="binds 8 fixed ports.*6 were given"):
        plan(topo, ["x"], tmp_path, ports=list(range(21000, 21006)))
    assert topo.slowest_link_bps == 1e9
    assert load_topology(None, wan="regional", global_server_link="100mbit").slowest_link_bps == 1e8
    with pytest.raises(ConfigError, match="--global-server-link.*needs an emulated WAN"):
        load_topology(None, wan="lan", global_server_link="1gbit")
    with pytest.raises(ConfigError, match="--global-server-link"):
        load_topology(None, wan="regional", global_server_link="fast")


def test_global_server_dcs_place_each_global_server_in_a_dcs_network_and_bad_places_are_named(tmp_path):
    from geomx.cli.launch import plan
    from geomx.cli.topology import load_topology
    from geomx.config import config_from_env

    topo = load_topology(None, dcs=3, global_servers=3, wan="regional", global_server_dcs="a,central,c")
    specs = plan(topo, ["python", "train.py"], tmp_path, ports=list(range(21000, 21006)))
    servers = sorted((s for s in specs if s.name.startswith("global-server-")), key=lambda s: s.name)
    assert [s.env.get("GEOMX_SITE") for s in servers] == ["a", None, "c"]
    assert all("GEOMX_SITE" not in s.env for s in specs if not s.name.startswith("global-server-"))
    # the node's configuration: its tier stays the central party's, its network is the DC's
    cfg = config_from_env({**servers[0].env, "DMLC_ROLE": "server"})
    assert (cfg.role, cfg.dc, cfg.network_dc, cfg.local_tier) == ("global_server", "central", "a", "dc:central")
    assert config_from_env({**servers[1].env, "DMLC_ROLE": "server"}).network_dc == "central"
    worker = next(s for s in specs if s.name == "a-worker-0")
    with pytest.raises(ConfigError, match="GEOMX_SITE='b'.*only a global server.*worker"):
        config_from_env({**worker.env, "GEOMX_SITE": "b"})
    for flags, words in [
        (dict(global_servers=2, global_server_dcs="a"), "names 1 place(s) but there are 2 global server(s)"),
        (dict(global_servers=1, global_server_dcs="x"), "global server 0 is placed in 'x', which is no DC"),
        (dict(global_servers=1, global_server_dcs="a", wan="lan"), "needs one (--wan lan has none)"),
        (dict(global_servers=1, global_server_dcs="a", topology="flat"), "the 'flat' topology"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_topology(None, **{"wan": "regional", **flags})
        assert "--global-server-dcs" in str(err.value) and words in str(err.value), str(err.value)


def test_the_run_manifest_records_every_wan_setting_the_emulator_was_given(tmp_path):
    """launch.json had recorded the profile alone: a run's TCP model, per-link overrides and lines were not in
    its manifest, so its report could not say what WAN it ran (found by a review)."""
    import json

    from geomx.cli.launch import Launcher
    from geomx.cli.topology import load_topology

    topo = load_topology(None, dcs=2, wan="regional", wan_links=["b=100mbit/50ms"], wan_streams=4,
                         wan_loss="0.01%", wan_dc_lines=True)
    launcher = Launcher(topo, ["x"], run_dir=tmp_path)
    launcher._started = 0.0
    launcher._write_manifest([])
    wan = json.loads((tmp_path / "launch.json").read_text())["wan"]
    assert wan["tcp"] == {"loss": 0.0001, "streams": 4, "window_bytes": None, "slow_start": False}
    assert "b->central=" in wan["links"] and "central->b=" in wan["links"]
    assert dc_lines.parse(wan["dc_lines"]) == {"a": (1e9, 1e9), "b": (1e8, 1e8)}
