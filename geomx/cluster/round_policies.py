"""What a local server does with a complete round of its DC: the registered round policies.

A policy class registers under a name with :func:`register_round_policy`; the global servers name the one the
deployment runs in their configuration (``info["round_policy"]``, chosen once in
``GlobalServer._configure`` from the mode, MixedSync variant and GeoMX HFA request), and every local server
builds one instance per policy and hands each complete round to the named one. geomx has

* ``wait`` (local_server.WaitForWan): one fused push-and-pull per round across the WAN, the reply answers the
  DC (FSA, MixedSync ``wait``);
* ``overlap`` (wan_overlap.WanOverlap): MixedSync ``overlap``, the DC answered at once;
* ``hfa`` (hfa_rounds.HfaServerRounds): GeoMX's HFA server logic for raw-kvstore HFA scripts.

A policy is built with the server (``cls(server)``) and has ``on_round(st, number, rnd)``; it keeps its per-key
memory in a typed, saveable part of the KeyState (see kvserver.KeyState).
"""
from __future__ import annotations

from collections.abc import Callable

from geomx.errors import ConfigError

ROUND_POLICIES: dict[str, type] = {}


def register_round_policy(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        if name in ROUND_POLICIES and ROUND_POLICIES[name] is not cls:
            raise ConfigError(f"round policy {name!r} is registered twice ({ROUND_POLICIES[name].__name__}, "
                              f"{cls.__name__})")
        ROUND_POLICIES[name] = cls
        return cls
    return add


def round_policy_name(*, mixedsync: str, hfa_k2: int | None) -> str:
    """The policy a deployment's local servers run (the global servers decide it once, at configuration)."""
    if hfa_k2:
        return "hfa"
    return "overlap" if mixedsync == "overlap" else "wait"
