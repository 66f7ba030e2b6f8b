"""Whether a ``run.resume`` target is a run directory: checked by the CLI before it starts
anything (no torch import, no rank processes for a one-line refusal) and again by the run
itself (``runtime/run.py``), with the same words."""

from __future__ import annotations

import json
from pathlib import Path

from accelopt.errors import UserError

CONFIG_FILE = "config.yaml"


def resume_target(value: str) -> Path:
    """``run.resume``'s directory, or a one-line :class:`UserError` naming the fix."""
    old_dir = Path(value).expanduser()
    if not old_dir.is_dir():
        raise UserError(f"run.resume: {old_dir} is not a directory; pass the directory of a "
                        "run that accelopt wrote (it holds config.yaml and checkpoints/)")
    if not (old_dir / CONFIG_FILE).is_file():
        raise UserError(f"run.resume: {old_dir} has no {CONFIG_FILE}; pass the directory of a "
                        "run that accelopt wrote")
    return old_dir


def finished(run_dir: Path) -> str:
    """Why ``run_dir`` counts as finished (every job done, by its metrics.json), or ''."""
    try:
        jobs = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))["jobs"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    statuses = [j.get("status") for j in jobs if isinstance(j, dict)]
    if statuses and all(s == "done" for s in statuses):
        return f"all {len(statuses)} job(s) done"
    return ""


def refuse_finished(old_dir: Path, resume_finished: bool) -> None:
    """A finished run is not resumed unless asked (``run.resume_finished=true``)."""
    why = finished(old_dir)
    if why and not resume_finished:
        raise UserError(f"run.resume: {old_dir} already finished ({why}); nothing to "
                        "resume. Start a new run, or add run.resume_finished=true to report "
                        "it again in a new directory")
