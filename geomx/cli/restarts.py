"""``geomx launch --restart-failed N``: a job whose deployment failed starts again from its last checkpoint.

When a role fails in a way no fault domain absorbs (a global server, a scheduler, a DC the job cannot spare), the
launcher stops every process as always; with restarts left, it then moves that attempt's logs, metrics and link
counters into ``<run dir>/attempt-<k>/`` and launches the whole deployment again, every role resuming from the
latest step that every worker, and every global server that checkpoints (a server optimizer, compressed
replies), saved in the checkpoint directory (``--checkpoint-every``, ``--checkpoint-seconds``; ``--checkpoint-dir``,
else ``<run dir>/checkpoints``). Steps after
that checkpoint are trained again: "no update lost" in the sense of issue 16 (every acknowledged round is in the
model after recovery, or the workers replay it), and since a resumed job replays the same batches, it ends on the
model of a job that never failed, bit for bit. Without a checkpoint yet, the job starts afresh.
"""
from __future__ import annotations

import shutil
from pathlib import Path


def restart_step(directory: Path, workers: int, global_servers: int) -> int | None:
    """The latest step that every worker checkpointed in ``directory`` and, if any global server checkpoints
    there, every global server too; None where there is none (start afresh)."""
    from geomx.cluster.server_checkpoint import rounds_saved
    from geomx.torch.checkpoint import steps_saved

    found = steps_saved(directory)
    if any(w not in found for w in range(workers)):
        return None
    common = set.intersection(*(set(found[w]) for w in range(workers)))
    servers = rounds_saved(directory)
    if servers:
        for rank in range(global_servers):
            common &= set(servers.get(rank, ()))
    return max(common) if common else None


def archive_attempt(run_dir: Path, attempt: int, role_names: list[str]) -> Path:
    """Move what a failed attempt wrote (geomx.cli.launch.run_files, and the workers' results) into
    ``run_dir/attempt-<attempt>``, at the same relative paths; the checkpoints stay for the next attempt."""
    from geomx.cli.launch import run_files

    target = run_dir / f"attempt-{attempt}"
    for path in [*run_files(run_dir, role_names), *run_dir.glob("result-*.json")]:
        if path.exists():
            moved = target / path.relative_to(run_dir)
            moved.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(moved))
    return target
