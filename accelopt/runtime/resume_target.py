"""Whether a ``run.resume`` target is a run directory: checked by the CLI before it starts
anything (no torch import, no rank processes for a one-line refusal) and again by the run
itself (``runtime/run.py``), with the same words."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from accelopt.errors import UserError

CONFIG_FILE = "config.yaml"
HONOURED = ("run.progress", "cluster.master_port", "cluster.timeout_s")
"""Settings a resumed run takes from its own command line rather than the old run's config:
they change neither the numerics nor the checkpoints (a busy rendezvous port, a timeout
that was too short), so refusing them would strand the checkpoints."""


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


def honoured(overrides: Iterable[str]) -> list[str]:
    """The :data:`HONOURED` keys that ``overrides`` sets (a resume takes those from its own
    command line; the old run's value stays where none is given)."""
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides if "=" in o}
    return [key for key in HONOURED if key in given]


def refuse_finished(old_dir: Path, resume_finished: bool) -> None:
    """A finished run is not resumed unless asked (``run.resume_finished=true``)."""
    why = finished(old_dir)
    if why and not resume_finished:
        raise UserError(f"run.resume: {old_dir} already finished ({why}); nothing to "
                        "resume. Start a new run, or add run.resume_finished=true to report "
                        "it again in a new directory")


def carry_checkpoints(source: Path, target_dir: Path) -> int:
    """Put the checkpoints under ``source`` (the resumed run's checkpoint directory) into
    ``target_dir`` (the new run's), as hard links (a copy across filesystems), before the
    resumed run starts, so that the new directory holds the state it started from: a
    resumed run that stops again, before its own first checkpoint or while starting, is
    resumed from there rather than from the beginning. A file already there is left as it is (the ranks of a torchrun resume each
    carry into the same directory). The old files are never written: a later checkpoint of
    the new run replaces its own entry (temp file + rename) or unlinks it. Returns the number
    of files carried."""
    carried = 0
    for path in sorted(source.rglob("*.pt")) if source.is_dir() else []:
        target = target_dir / path.relative_to(source)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except FileExistsError:
            continue
        except OSError:  # another filesystem, or one without hard links
            tmp = target.with_name(f".{target.name}.{os.getpid()}.carry")
            shutil.copyfile(path, tmp)
            os.replace(tmp, target)
        carried += 1
    return carried
