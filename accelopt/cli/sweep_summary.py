"""``sweep.json``: a sweep's points in one machine-readable file, in its sweep directory.

A CI step that sweeps plugin sets (``accelopt run -m ...``) needs to know which points
failed and why, and where each point's results are. The sweep's stderr says so in prose
(each run's error line and a closing line), and each run directory holds its own
``metrics.json``; without this file a step had to parse the prose or walk the directories
and guess which points never ran. It is rewritten (atomically) after every point, so a
sweep that was stopped leaves the points that ran, ``"complete": false``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelopt.atomic import atomic_open

SWEEP_JSON = "sweep.json"

DONE, FAILED, INTERRUPTED = "done", "failed", "interrupted"


@dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep as it ended."""

    point: int
    """Its number: the run directory's name under the sweep directory (Hydra's job number)."""
    overrides: list[str]
    """The sweep's overrides that make this point (Hydra's ``overrides.task``)."""
    run_dir: str | None
    """Its run directory, relative to the sweep directory; ``None`` where the point was
    refused before it wrote anything (no directory was left)."""
    status: str
    """``done``, ``failed`` (``error`` says why) or ``interrupted`` (Ctrl-C, SIGTERM)."""
    exit_code: int
    """What ``accelopt run`` would have exited with for this point alone."""
    error: str | None = None
    """The point's error line, without its ``error:`` prefix."""
    inert_plugins: list[str] = field(default_factory=list)
    """Its plugins whose every report row said they changed nothing."""


def run_dir_shown(sweep_dir: Path, run_dir: Path) -> str | None:
    """A point's ``run_dir`` field: relative to the sweep directory where it lies inside it,
    else as given; ``None`` where the point left no directory."""
    if not run_dir.is_dir():
        return None
    base, here = Path(sweep_dir).resolve(), run_dir.resolve()
    return str(here.relative_to(base) if here.is_relative_to(base) else run_dir)


def points_written(sweep_dir: Path) -> list[SweepPoint]:
    """The points ``sweep_dir``'s ``sweep.json`` holds already (none where there is none):
    a launcher that is given a sweep in batches adds each batch's points to them."""
    try:
        written = json.loads((Path(sweep_dir) / SWEEP_JSON).read_text(encoding="utf-8"))
        return [SweepPoint(**point) for point in written["points"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def point_status(exit_code: int, error: str, interrupted: bool) -> str:
    if interrupted:
        return INTERRUPTED
    return FAILED if exit_code or error else DONE


def write_sweep_summary(sweep_dir: Path, points: Sequence[SweepPoint], *,
                        complete: bool, launcher: str, exit_code: int) -> Path:
    """Write ``sweep.json`` (replacing the one of this sweep's earlier points) and return
    its path. ``complete``: every point of the sweep ran (or was refused); ``False`` while
    it runs and where it was stopped. ``exit_code``: the sweep's, as its command exits."""
    summary = {
        "complete": complete,
        "launcher": launcher,
        "exit_code": exit_code,
        "points_run": len(points),
        "failed": [p.point for p in points if p.status != DONE],
        "points": [asdict(p) for p in points],
    }
    path = Path(sweep_dir) / SWEEP_JSON
    with atomic_open(path, encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
        handle.write("\n")
    return path


def write_and_say(sweep_dir: Path, points: Sequence[SweepPoint], *, complete: bool,
                  launcher: str, exit_code: int, say_where: bool) -> Path | None:
    """:func:`write_sweep_summary` as both launchers write it: a write the machine refused (a
    full disk) is one ``note:`` line on stderr (the runs' own outputs and lines say the
    rest), and with ``say_where`` (the sweep ends here) the file's path is the ``sweep
    summary: PATH`` line a CI step reads last on stdout."""
    try:
        path = write_sweep_summary(sweep_dir, points, complete=complete, launcher=launcher,
                                   exit_code=exit_code)
    except OSError as exc:
        print(f"note: {Path(sweep_dir) / SWEEP_JSON} not written ({exc.strerror or exc})",
              file=sys.stderr)
        return None
    if say_where:
        print(f"sweep summary: {path}")
    return path
