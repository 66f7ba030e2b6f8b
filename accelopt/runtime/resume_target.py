"""Whether a ``run.resume`` target is a run directory: checked by the CLI before it starts
anything (no torch import, no rank processes for a one-line refusal) and again by the run
itself (``runtime/run.py``), with the same words."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from accelopt.errors import UserError, error_text

CONFIG_FILE = "config.yaml"
PACKED_SWEEP_DIR = "salus-pack"
"""The shared execution of a ``hydra/launcher=salus`` sweep, inside its sweep directory: the
launcher splits it into the sweep's run directories after it ends, which a resume of it
does not (the launcher is not running then)."""
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
    run_config(old_dir)
    return old_dir


def run_config(old_dir: Path) -> Any:
    """``old_dir``'s ``config.yaml`` merged into the config schema, or a one-line
    :class:`UserError`: a file of other keys (the merge's traceback, after the new
    directory was made) or one with no workload (taken as a run, which then had no jobs)."""
    from omegaconf import OmegaConf

    from accelopt.config import AccelConfig

    path = old_dir / CONFIG_FILE
    not_a_run = (f"run.resume: {path} is not the config of a run that accelopt wrote "
                 "({}); pass the directory of such a run")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(AccelConfig), OmegaConf.load(path))
    except Exception as exc:  # noqa: BLE001 - YAML, schema and type errors alike
        raise UserError(not_a_run.format(error_text(exc))) from None
    if not OmegaConf.select(cfg, "workload.jobs") and not OmegaConf.select(
            cfg, "workload.generate.n_jobs"):
        raise UserError(not_a_run.format("its workload has no jobs"))
    return cfg


def run_mode(cfg: Any) -> str:
    """The cluster mode ``cfg`` runs in. A resume runs with the resumed run's saved config
    (``runtime/run.py``), not with the one composed from its overrides (the default
    workload's), so its mode is the saved one: a one-process run resumed at a script's top
    level was refused as a cluster run (``accelopt.run``), and the command line started
    the ranks' process server for it."""
    resume = cfg.run.get("resume")
    if resume is None or not str(resume).strip():  # none, or empty (refused as the run starts)
        return str(cfg.cluster.mode)
    return str(run_config(resume_target(str(resume))).cluster.mode)


def packed_sweep_note(old_dir: Path, run_dir: Path) -> str:
    """The line a resume of a ``hydra/launcher=salus`` sweep's shared execution says (or
    ''): its jobs resume, but into one run directory, not split into the sweep's runs."""
    name = old_dir.resolve().name  # a batched sweep's later batches: salus-pack-<k>
    if name != PACKED_SWEEP_DIR and not name.startswith(f"{PACKED_SWEEP_DIR}-"):
        return ""
    return (f"note: {old_dir} is a hydra/launcher=salus sweep's shared execution: its jobs "
            f"resume into this one directory ({run_dir}; job r<k>-<name> is run k's), not "
            "into the sweep's run directories; to get those, run the sweep again")


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


def references_unfinished(run_dir: Path) -> str:
    """The ``run.compare`` mode of a run stopped before its reference runs ended ('' for
    any other run). Why its config tells: a run writes its ``config.yaml`` before the
    references still asking for them, and again without them once they ended or when it
    runs none (``runtime/run.py``), so a config that asks for them is of a run whose own
    jobs never began."""
    from omegaconf import OmegaConf

    try:
        mode = OmegaConf.select(OmegaConf.load(run_dir / CONFIG_FILE), "run.compare")
    except Exception:  # noqa: BLE001 - no config, or not one of ours: not such a run
        return ""
    return "" if mode in (None, "none") else str(mode)


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
