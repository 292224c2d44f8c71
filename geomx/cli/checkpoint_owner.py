"""A checkpoint directory holds the checkpoints of one run.

Each worker keeps its last two checkpoints by deleting every older step of its index in the directory, and
``--resume`` reads the latest step that every worker has there. Two runs writing into one directory (a shared
``--checkpoint-dir``, or a second launch into a run directory whose checkpoints are still there) therefore
deleted each other's files, and a resume of one silently loaded the other's model. ``geomx launch`` claims the
directory of a run that checkpoints (``owner.json``: the run directory) and refuses one that holds checkpoints
of another launch. Restarts within one launch (``--restart-failed``) keep using the directory they claimed.
"""
from __future__ import annotations

import json
from pathlib import Path

from geomx.errors import ConfigError

OWNER_FILE = "owner.json"


def owner_of(directory: Path) -> str | None:
    """The run directory that claimed ``directory``, if one did."""
    try:
        owner = json.loads((directory / OWNER_FILE).read_text()).get("run_dir")
    except (OSError, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def holds_checkpoints(directory: Path) -> bool:
    from geomx.cluster.server_checkpoint import rounds_saved
    from geomx.torch.checkpoint import steps_saved

    return directory.is_dir() and bool(steps_saved(directory) or rounds_saved(directory))


def claim(directory: Path, run_dir: Path) -> None:
    """Make ``directory`` the checkpoint directory of the run in ``run_dir``, or say why it cannot be."""
    run = str(run_dir.resolve())
    owner = owner_of(directory)
    if owner is not None and owner != run:
        raise ConfigError(f"checkpoint directory {directory} holds the checkpoints of the run in {owner}: give "
                          f"this run a directory of its own (--checkpoint-dir), or its workers would delete that "
                          f"run's checkpoints and a --resume of either run would read the other's")
    if holds_checkpoints(directory):
        where = "an earlier launch of this run directory" if owner == run else "a run that did not claim it"
        raise ConfigError(f"checkpoint directory {directory} already holds checkpoints of {where}: resume them "
                          f"with --resume {run_dir if owner == run else 'THAT_RUN_DIR'} --run-dir NEW_DIR, or "
                          f"give this run another directory (--checkpoint-dir, --run-dir), or remove them to "
                          f"start over")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / OWNER_FILE).write_text(json.dumps({"run_dir": run}) + "\n")
