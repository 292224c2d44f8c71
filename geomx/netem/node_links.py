"""A node's own link: the line between one host and the WAN, which every DC's traffic to that host shares.

The link matrix (geomx.netem.link_matrix) gives every directed DC pair its own line, so with the global servers
at the central party nothing models what GeoMX's MultiGPS is for: one global server's network interface
receives the pushes of every DC at once (in-cast) and sends every reply. A node link is that interface: a line
of its own rate, in each direction, in tandem with the WAN links (geomx.netem.link): a message from DC ``a`` to
a node with a link crosses ``a->central`` and then the node's ingress line, chunk by chunk; a reply crosses the
node's egress line, then ``central->a``. Eight DCs pushing to one global server on a 1 Gbit/s node link share
that 1 Gbit/s; with four global servers, each on its own, they share 4 Gbit/s.

Named by the address the node listens on: ``GEOMX_WAN_NODE_LINKS=127.0.0.1:7001=1gbit,127.0.0.1:7002=1gbit``
(the emulator's variable). ``geomx launch --global-server-link RATE`` gives each global server a fixed port and
such a link; the van names its own address in every message it sends through the emulator (the route's
``src``), so the emulator knows both ends.
"""
from __future__ import annotations

from geomx.netem.line_specs import parse_rated, rated_env

ENV = "GEOMX_WAN_NODE_LINKS"


def _host_port(node: str) -> bool:
    host, colon, port = node.rpartition(":")
    return bool(colon and host and port.isdigit() and 0 < int(port) < 65536)


def parse(text: str | None) -> dict[str, float]:
    """``"HOST:PORT=RATE,..."`` -> {"tcp://HOST:PORT": bit/s}; every error names the variable and the entry."""
    rates = parse_rated(text, ENV, "HOST:PORT=RATE (e.g. 127.0.0.1:7001=1gbit)", _host_port)
    return {f"tcp://{node}": rate for node, rate in rates.items()}


def to_env(links: dict[str, float]) -> str:
    """The inverse of :func:`parse`, every digit kept."""
    return rated_env({addr.removeprefix("tcp://"): rate for addr, rate in links.items()})
