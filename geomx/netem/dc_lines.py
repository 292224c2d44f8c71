"""A DC's own line to the WAN: the uplink and downlink that all of a DC's cross-DC traffic shares.

The emulator gives every directed DC pair a link of its own (geomx.netem.link_matrix). While every DC talks only
to the central party that is each DC's uplink, but once DCs talk to each other (a global server placed inside a
DC, ``--global-server-dcs``) a DC that sends to three others would get three links' worth of rate. A DC line is
the DC's one connection to the WAN, in each direction, in tandem with the pair links (geomx.netem.link): a
message from DC ``a`` to DC ``b`` crosses ``a``'s egress line, the ``a->b`` link and ``b``'s ingress line, chunk
by chunk, so everything ``a`` sends shares ``a``'s line.

``GEOMX_WAN_DC_LINES=a=1gbit,b=50mbit/250mbit`` (the emulator's variable: ``DC=UP[/DOWN]``, the uplink and, where
it differs, the downlink); ``geomx launch --wan-dc-lines`` gives every DC one at its links' rates: up at its
link's to the central party, down at the central party's to it (``--wan-link`` overrides included), so an
asymmetric profile keeps its downlink.
"""
from __future__ import annotations

from geomx.netem.line_specs import parse_rated, rated_env

ENV = "GEOMX_WAN_DC_LINES"


def parse(text: str | None) -> dict[str, tuple[float, float]]:
    """``"DC=UP[/DOWN],..."`` -> {DC: (uplink, downlink) bit/s}; every error names the variable and the entry."""
    return parse_rated(text, ENV, "DC=RATE or DC=UP/DOWN (e.g. a=1gbit, b=50mbit/250mbit)", lambda dc: "=" not in dc,
                       two_way=True)


def to_env(lines: dict[str, tuple[float, float]]) -> str:
    """The inverse of :func:`parse`, every digit kept."""
    return rated_env(lines)
