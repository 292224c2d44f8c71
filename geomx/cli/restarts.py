"""``geomx launch --restart-failed N``: a job whose deployment failed starts again from its last checkpoint.

When a role fails in a way no fault domain absorbs (a global server, a scheduler, a DC the job cannot spare), the
launcher stops every process as always; with restarts left, it then moves that attempt's logs, metrics and link
counters into ``<run dir>/attempt-<k>/`` and launches the whole deployment again, every role resuming from the
latest step that every worker, and every global server that checkpoints (a server optimizer), saved in
``<run dir>/checkpoints`` (``--checkpoint-every``). Steps after that checkpoint are trained again: "no update
lost" in the sense of issue 16 (every acknowledged round is in the model after recovery, or the workers replay
it), and since a resumed job replays the same batches, it ends on the model of a job that never failed, bit for
bit. Without a checkpoint yet, the job starts afresh.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from geomx.dropped import FILE as DROPPED_FILE
from geomx.metrics import METRICS_DIR
from geomx.netem.emulator import STATS_FILE

_SERVER_FILE = re.compile(r"global-server-(\d+)-round-(\d+)\.state$")
ATTEMPT_FILES = ("launch.json", STATS_FILE, DROPPED_FILE)


def restart_step(directory: Path, workers: int, global_servers: int) -> int | None:
    """The latest step that every worker checkpointed in ``directory`` and, if any global server checkpoints
    there, every global server too; None where there is none (start afresh)."""
    from geomx.torch.checkpoint import steps_saved

    found = steps_saved(directory)
    if any(w not in found for w in range(workers)):
        return None
    common = set.intersection(*(set(found[w]) for w in range(workers)))
    servers: dict[int, set[int]] = {}
    for entry in directory.iterdir() if directory.is_dir() else ():
        m = _SERVER_FILE.match(entry.name)
        if m:
            servers.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if servers:
        for rank in range(global_servers):
            common &= servers.get(rank, set())
    return max(common) if common else None


def archive_attempt(run_dir: Path, attempt: int, role_names: list[str]) -> Path:
    """Move what a failed attempt wrote (its roles' logs, metrics, link counters, drop log, manifest, the
    workers' results) into ``run_dir/attempt-<attempt>``; the checkpoints stay for the next attempt."""
    target = run_dir / f"attempt-{attempt}"
    target.mkdir(parents=True, exist_ok=True)
    paths = [run_dir / f"{name}.log" for name in role_names] + [run_dir / name for name in ATTEMPT_FILES]
    paths += [run_dir / METRICS_DIR, *run_dir.glob("result-*.json")]
    for path in paths:
        if path.exists():
            shutil.move(str(path), str(target / path.name))
    return target
