"""The emulator's TCP ceiling (geomx.netem.tcp_model): loss and window per stream against their formulas; the
settings from flags, a topology file and variables, bad ones named. (A link serializing at that goodput is
timed in test_netem.py, with its retries.)"""
from __future__ import annotations

import math

import pytest

from geomx.errors import ConfigError
from geomx.netem.tcp_model import MSS_BYTES, TcpPath, tcp_path, tcp_path_from_env

MBIT = 1e6


def test_one_streams_ceiling_is_the_mathis_rate_under_loss_and_window_over_rtt_under_a_window():
    # MSS * sqrt(3/2) / (RTT * sqrt(p)): 0.01% loss over 80 ms leaves one stream 17.7 Mbit/s
    mathis = MSS_BYTES * 8 * math.sqrt(1.5) / (0.08 * math.sqrt(1e-4))
    assert TcpPath(loss=1e-4).stream_bps(0.08) == pytest.approx(mathis)
    assert 17.5 * MBIT < mathis < 17.9 * MBIT
    # Linux's default 6 MiB receive buffer over 180 ms: 280 Mbit/s
    assert TcpPath(window_bytes=6 << 20).stream_bps(0.18) == pytest.approx((6 << 20) * 8 / 0.18)
    # the lower of the two, and nothing at all without either or without an RTT
    both = TcpPath(loss=1e-4, window_bytes=64 << 10)
    assert both.stream_bps(0.08) == pytest.approx(min(mathis, (64 << 10) * 8 / 0.08))
    assert TcpPath().stream_bps(0.08) == math.inf and TcpPath(loss=0.01).stream_bps(0.0) == math.inf


def test_streams_add_up_to_the_line_rate_and_no_further():
    path = TcpPath(loss=1e-4, streams=4)
    one = TcpPath(loss=1e-4).stream_bps(0.08)
    assert path.goodput_bps(1e9, 0.08) == pytest.approx(4 * one)
    assert TcpPath(loss=1e-4, streams=64).goodput_bps(1e9, 0.08) == 1e9
    assert TcpPath().goodput_bps(1e9, 0.08) == 1e9 and not TcpPath(streams=8).limits


@pytest.mark.parametrize("settings, named", [
    ({"loss": "1.5"}, "GEOMX_WAN_LOSS"), ({"loss": "lots"}, "GEOMX_WAN_LOSS"), ({"loss": "-1%"}, "--wan-loss"),
    ({"streams": "0"}, "GEOMX_WAN_STREAMS"), ({"streams": "two"}, "GEOMX_WAN_STREAMS"),
    ({"window": "100"}, "GEOMX_WAN_WINDOW")])
def test_bad_tcp_settings_are_refused_naming_the_setting(settings, named):
    with pytest.raises(ConfigError, match=named):
        tcp_path(**settings)


def test_the_settings_travel_from_flags_to_the_emulators_variables(tmp_path):
    from geomx.cli.launch import plan
    from geomx.cli.topology import load_topology

    topo = load_topology(None, wan="transpacific", wan_loss="0.01%", wan_streams=4, wan_window=4 << 20)
    assert topo.tcp == TcpPath(loss=1e-4, streams=4, window_bytes=4 << 20)
    rtt = topo.profile.rtt_s
    assert topo.slowest_link_bps == pytest.approx(min(topo.profile.uplink_bps, topo.tcp.goodput_bps(
        topo.profile.uplink_bps, rtt)))
    (emulator,) = [s for s in plan(topo, ["python", "train.py"], tmp_path) if s.kind == "emulator"]
    assert tcp_path_from_env(emulator.env) == topo.tcp
    with pytest.raises(ConfigError, match="need an emulated WAN"):
        load_topology(None, wan="lan", wan_loss="0.01%")


def test_wan_loss_profile_takes_the_profiles_own_loss_and_the_profiles_name_one():
    from geomx.cli.topology import load_topology
    from geomx.profiles import PROFILES

    assert {name: p.loss for name, p in PROFILES.items()} == {
        "lan": 0.0, "regional": 0.0, "transatlantic": 1e-4, "transpacific": 5e-4, "volunteer": 1e-3}
    topo = load_topology(None, wan="transpacific", wan_loss="profile")
    assert topo.tcp.loss == 5e-4 and topo.tcp.streams == 1
    # one stream over 180 ms with 0.05% loss: the Mathis rate, 3.5 Mbit/s of the 100 Mbit/s line
    assert topo.slowest_link_bps == pytest.approx(MSS_BYTES * 8 * math.sqrt(1.5) / (0.18 * math.sqrt(5e-4)))
    assert load_topology(None, wan="regional", wan_loss="profile").tcp.loss == 0.0
