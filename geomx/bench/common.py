"""Helpers shared by the ``geomx bench`` sub-commands: deployments, report files, tables, machine facts.

Every figure a benchmark prints is measured in that run; the helpers here only start processes, read what
they wrote and format it.
"""
from __future__ import annotations

import io
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from collections.abc import Iterator, Sequence

from geomx import json_text
from geomx.errors import ConfigError, GeomxError

MIB = 1024 * 1024


# -- paths and run directories ---------------------------------------------------------------------------------

def train_script_path(name: str = "train_cnn.py") -> Path:
    """examples/<name> next to the installed geomx package (editable install or source checkout)."""
    import geomx

    path = Path(geomx.__file__).resolve().parent.parent / "examples" / name
    if not path.is_file():
        raise ConfigError(f"the WAN benchmark runs examples/{name}, which is not at {path}: geomx must be "
                          f"installed from a source checkout (pip install -e .) for this benchmark")
    return path


@contextmanager
def run_directory(run_dir: str | None, name: str) -> Iterator[Path]:
    """``run_dir`` if given (kept afterwards), else a temporary directory removed at the end."""
    if run_dir:
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=f"geomx-bench-{name}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port outside the ephemeral range, free now (see geomx.cli.launch.free_ports)."""
    from geomx.cli.launch import free_ports
    return free_ports(1, host)[0]


# -- deployments ---------------------------------------------------------------------------------------------

def launch(topo, command: list[str], run_dir: Path, timeout: float, what: str, *, secure: bool = False) -> float:
    """Run ``command`` in a whole deployment of ``topo`` (geomx's Launcher; ``secure``: as ``--secure``); returns
    the wall time in seconds. Raises GeomxError with the launcher's report (which names the failed role) if
    anything fails."""
    from geomx.cli.launch import Launcher

    out = io.StringIO()
    t0 = time.monotonic()
    rc = Launcher(topo, command, run_dir=run_dir, quiet=True, out=out, secure=secure).run(timeout=timeout)
    if rc != 0:
        raise GeomxError(f"{what}: the deployment failed (exit status {rc}; logs in {run_dir}).\n"
                         f"{out.getvalue().strip()}")
    return time.monotonic() - t0


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GeomxError(f"{what}: {path} was not written") from None
    except json.JSONDecodeError as exc:
        raise GeomxError(f"{what}: {path} is not valid JSON: {exc}") from None


def bench_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark subprocess: geomx importable, one compute thread per process."""
    import geomx

    env = dict(os.environ)
    root = str(Path(geomx.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# -- numbers ---------------------------------------------------------------------------------------------------

def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def parse_sizes(text: str) -> list[float]:
    """'1,4,16' -> [1.0, 4.0, 16.0] (sizes in MiB); every size > 0."""
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"cannot read sizes from {text!r}; write e.g. 1,4,16,64,256 (MiB)") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise ConfigError(f"sizes must be > 0 MiB, got {text!r}")
    return sizes


def fmt_mib(x: float) -> str:
    return f"{x:g} MiB"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] | None = None) -> str:
    right = right or [i > 0 for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- reports ---------------------------------------------------------------------------------------------------

def command_line(args) -> str:
    """The command that ran: sys.argv when it is the geomx command, else the parsed arguments spelled out
    (benchmarks called from Python, e.g. the tests)."""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    if argv0 == "geomx" or sys.argv[0].endswith(os.path.join("geomx", "cli", "main.py")):
        return "geomx " + shlex.join(sys.argv[1:])
    return "geomx " + shlex.join(spelled_out(args))


def spelled_out(args) -> list[str]:
    """``bench <name>`` plus every option whose value differs from its default, from the sub-command's parser
    (stored as ``args.bench_parser`` by geomx.bench.cli)."""
    argv = ["bench", str(getattr(args, "bench", "?"))]
    parser = getattr(args, "bench_parser", None)
    if parser is None:
        return argv
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default or value is False:
            continue
        argv.append(action.option_strings[-1] if action.option_strings[-1].startswith("--") else
                    action.option_strings[0])
        if value is not True:
            argv.append(str(value))
    return argv


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages * page / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        pass
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"GPU {torch.cuda.get_device_name(0)}"
    except Exception:   # torch missing or broken: the benchmark that needs it says so itself
        pass
    load = ""
    with suppress(OSError):
        load = f"; load average at the end {os.getloadavg()[0]:.1f}"
    return f"{os.cpu_count()} CPU cores ({cpu}){mem}, {gpu}, Linux {platform.release()}, Python " \
           f"{platform.python_version()}{load}"


def emit_report(args, title: str, body: str, result: dict) -> None:
    """Print the report; with ``--output FILE`` also append it with the command line, date and machine; with
    ``--json FILE`` write the raw ``result``."""
    if getattr(args, "json", None):
        Path(args.json).write_text(json_text.dumps(result, indent=1))
    section = "\n".join([f"## {title}", "",
                         f"* command: `{command_line(args)}`",
                         f"* date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
                         f"* machine: {machine_description()}",
                         "", body.strip(), ""])
    print(section)
    output = getattr(args, "output", None)
    if output:
        path = Path(output)
        if path.parent and not path.parent.exists():
            raise ConfigError(f"--output {output}: directory {path.parent} does not exist")
        with open(path, "a") as f:
            f.write("\n" + section)
        print(f"(appended to {path})", file=sys.stderr)


def dispatch_helper(module: str, commands: dict, argv: list[str] | None) -> int:
    """``python -m geomx.bench.<module> COMMAND ...``: the helper processes a bench starts for itself."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in commands:
        print(f"usage: python -m geomx.bench.{module} {{{','.join(commands)}}} ... (started by geomx bench "
              f"{module})", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
