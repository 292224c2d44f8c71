"""Live progress of a launched run, read from the run directory while it grows.

Per DC: the steps its workers reached, the latest loss and test accuracy; per WAN link: the throughput of the
last complete second (the emulator's series). On a terminal it is a rich live table; elsewhere (logs, CI) a
compact status line every ``line_every_s`` seconds.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TextIO

from geomx.metrics import METRICS_DIR, parse_record


GONE_AFTER_S = 20.0


class RunWatcher:
    """Reads new metrics lines incrementally (keeps one offset per file)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._offsets: dict[Path, int] = {}
        self._dc_of: dict[Path, str] = {}
        self.workers: dict[Path, dict] = {}          # file -> latest {"step", "loss", "test_acc"}

    def poll(self) -> None:
        for f in sorted((self.run_dir / METRICS_DIR).glob("worker-*.jsonl")):
            with open(f, "rb") as fh:
                fh.seek(self._offsets.get(f, 0))
                chunk = fh.read()
            done = chunk.rfind(b"\n") + 1           # a line still being written waits for the next poll
            self._offsets[f] = self._offsets.get(f, 0) + done
            for rec in map(parse_record, chunk[:done].splitlines()):
                if rec is None:
                    continue
                if rec.get("kind") == "start":
                    self._dc_of[f] = rec.get("dc", "?")
                elif rec.get("kind") == "step":
                    state = self.workers.setdefault(f, {})
                    state["step"], state["loss"], state["t"] = rec["step"], rec.get("loss"), rec.get("t", 0.0)
                    if rec.get("test_acc") is not None:
                        state["test_acc"] = rec["test_acc"]

    def by_dc(self) -> dict[str, dict]:
        # a worker that stopped stepping long after its DC's others stepped is gone (killed, and maybe restarted
        # under a new process): its last step is not the DC's
        newest: dict[str, float] = {}
        for f, state in self.workers.items():
            dc = self._dc_of.get(f, "?")
            newest[dc] = max(newest.get(dc, 0.0), state.get("t", 0.0))
        # so is a whole DC that stopped stepping long after the others stepped (dropped): it is marked stopped
        latest = max(newest.values(), default=0.0)
        out: dict[str, dict] = {}
        for f, state in self.workers.items():
            if state.get("t", 0.0) < newest[self._dc_of.get(f, "?")] - GONE_AFTER_S:
                continue
            name = self._dc_of.get(f, "?")
            dc = out.setdefault(name, {"steps": [], "loss": None, "test_acc": None,
                                       "stopped": newest[name] < latest - GONE_AFTER_S})
            dc["steps"].append(state.get("step", 0))
            dc["loss"] = state.get("loss") if state.get("loss") is not None else dc["loss"]
            dc["test_acc"] = state.get("test_acc") if state.get("test_acc") is not None else dc["test_acc"]
        return out

    def link_rates(self) -> dict[str, float]:
        """Mbit/s of each WAN link over its last complete second."""
        try:
            stats = json.loads((self.run_dir / "wan_links.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        rates = {}
        for name, link in stats.get("links", {}).items():
            series = link.get("series") or []
            last = series[-2] if len(series) >= 2 else (series[-1] if series else 0)
            rates[name] = last * 8 / 1e6
        return rates


def step_range(steps: list[int]) -> str:
    """"12" when a DC's workers agree, "11-12" when they do not."""
    low, high = min(steps), max(steps)
    return f"{low}" if low == high else f"{low}-{high}"


def status_line(watcher: RunWatcher) -> str:
    parts = []
    for dc, s in sorted(watcher.by_dc().items()):
        if s["stopped"]:
            parts.append(f"DC {dc}: stopped at step {step_range(s['steps'])}")
            continue
        text = f"DC {dc}: step {step_range(s['steps'])}"
        if s["loss"] is not None:
            text += f" loss {s['loss']:.3f}"
        if s["test_acc"] is not None:
            text += f" acc {s['test_acc']:.3f}"
        parts.append(text)
    rates = watcher.link_rates()
    if rates:
        parts.append("WAN " + ", ".join(f"{n} {r:.0f} Mbit/s" for n, r in sorted(rates.items())))
    return " | ".join(parts)


def progress_table(watcher: RunWatcher):
    from rich.table import Table

    table = Table(title="geomx: training progress", expand=False)
    for col in ("DC", "steps", "loss", "test acc"):
        table.add_column(col, justify="right" if col != "DC" else "left")
    for dc, s in sorted(watcher.by_dc().items()):
        table.add_row(f"{dc} (stopped)" if s["stopped"] else dc, step_range(s["steps"]),
                      "-" if s["loss"] is None else f"{s['loss']:.4f}",
                      "-" if s["test_acc"] is None else f"{s['test_acc']:.4f}")
    for name, rate in sorted(watcher.link_rates().items()):
        table.add_row(f"WAN {name}", "", "", f"{rate:.0f} Mbit/s")
    return table


class Progress:
    """Runs in the launcher while the deployment trains; ``stop()`` at the end."""

    def __init__(self, run_dir: Path, out: TextIO, *, line_every_s: float = 10.0) -> None:
        self.watcher = RunWatcher(run_dir)
        self.out, self.line_every_s = out, line_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self.live = None
        if getattr(out, "isatty", lambda: False)():
            from rich.console import Console
            from rich.live import Live

            self.live = Live(progress_table(self.watcher), console=Console(file=out), refresh_per_second=2,
                             transient=False)

    def start(self) -> None:
        if self.live is not None:
            self.live.start()
        self._thread.start()

    def print(self, text: str) -> bool:
        """Print through the live display (above it); False when there is none."""
        if self.live is None:
            return False
        self.live.console.print(text, markup=False, highlight=False)
        return True

    def _loop(self) -> None:
        last_line = time.monotonic()
        while not self._stop.wait(0.5):
            try:
                self.watcher.poll()
            except OSError:
                continue
            if self.live is not None:
                self.live.update(progress_table(self.watcher))
            elif time.monotonic() - last_line >= self.line_every_s and self.watcher.workers:
                last_line = time.monotonic()
                print(f"geomx: {status_line(self.watcher)}", file=self.out, flush=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self.live is not None:
            self.watcher.poll()
            self.live.update(progress_table(self.watcher))
            self.live.stop()
