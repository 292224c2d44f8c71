"""Whole geomx deployments inside the test process: the real schedulers, servers and clients, each node on
its own van (threads, not processes), torn down by ``close``.

``FlatCluster``: the global tier's global servers serve the training workers directly (GeoMX's flat
topology) plus the central party (master worker). Node ids are fixed (``worker-0``...), so a server's saved
state names the same clients in a second cluster built the same way.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from geomx.cluster.client import KVClient
from geomx.cluster.global_server import start_global_server
from geomx.cluster.postoffice import Postoffice
from geomx.cluster.scheduler import Scheduler
from geomx.config import NodeConfig
from geomx.profiles import CENTRAL_DC

_DEADLINE_S = 20.0


def start_scheduler(tier: str, dc: str, expected: dict, **van) -> tuple[Scheduler, threading.Thread]:
    sched = Scheduler(tier=tier, dc=dc, expected=expected, port=0, heartbeat_timeout=60.0, connect_timeout=30.0,
                      **van)
    thread = threading.Thread(target=sched.serve, name=f"scheduler-{tier}", daemon=True)
    thread.start()
    end = time.monotonic() + _DEADLINE_S
    while not sched.van.port:
        if time.monotonic() > end:
            raise TimeoutError(f"the {tier} scheduler did not bind within {_DEADLINE_S:g} s")
        time.sleep(0.005)
    return sched, thread


class Client:
    """A worker or the master worker: a postoffice joined to one tier, and the KVClient on it."""

    def __init__(self, cfg: NodeConfig, node_id: str, tier: str, scheduler: tuple, declared: dict) -> None:
        self.po = Postoffice(cfg, node_id=node_id)
        self.kv: KVClient | None = None
        self.po.on_data = lambda msg: self.kv.handle_reply(msg) if msg.op == "reply" and self.kv else None
        self.po.start()
        try:
            joined = self.po.join(tier, scheduler, CENTRAL_DC, "worker", declared)
            self.kv = KVClient(self.po, joined, master=cfg.role == "master")
        except BaseException:
            self.po.close()
            raise


class FlatCluster:
    """One global server, ``num_workers`` workers in DC ``a`` (flat: they are the global tier's workers), the
    master worker."""

    def __init__(self, num_workers: int = 2) -> None:
        self._stops: list = []
        self.global_sched, _ = start_scheduler("global", CENTRAL_DC, {"server": 1, "worker": num_workers})
        self._stops.append(self.global_sched.stop)
        self.central_sched, _ = start_scheduler("dc:central", CENTRAL_DC, {"server": 1, "worker": 1})
        self._stops.append(self.central_sched.stop)
        gs, cs = ("127.0.0.1", self.global_sched.van.port), ("127.0.0.1", self.central_sched.van.port)
        counts = {"num_global_servers": 1, "num_global_workers": num_workers, "num_all_workers": num_workers}
        server_cfg = NodeConfig(role="global_server", dc=CENTRAL_DC, scheduler=cs, global_scheduler=gs,
                                num_workers=1, num_servers=1, **counts)
        self.done = threading.Event()
        with ThreadPoolExecutor(num_workers + 2) as pool:
            server = pool.submit(start_global_server, server_cfg, self.done, node_id="global_server-0")
            master = pool.submit(Client, NodeConfig(role="master", dc=CENTRAL_DC, scheduler=cs, num_workers=1,
                                                    num_servers=1, **counts),
                                 "master", "dc:central", cs, {"num_workers": 1, "num_servers": 1})
            workers = [pool.submit(Client, NodeConfig(role="worker", dc="a", global_scheduler=gs, **counts),
                                   f"worker-{i}", "global", gs, counts) for i in range(num_workers)]
        nodes = [self._adopt(f) for f in (server, master, *workers)]
        if any(node is None for node in nodes):
            self.close()
            raise next(f.exception() for f in (server, master, *workers) if f.exception() is not None)
        self.server, self.master, *self.workers = nodes

    def _adopt(self, future):
        """The node a start-up future made (closed with the cluster), or None if it failed."""
        if future.exception() is not None:
            return None
        node = future.result()
        self._stops.insert(0, node.po.close)
        return node

    def close(self) -> None:
        for stop in self._stops:
            stop()
        self._stops = []
