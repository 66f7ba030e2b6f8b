"""A run directory holds one run: claimed when the run starts, never written over.

Why a claim and not only a look for ``metrics.json``: that file is written when the run
ends, so two runs started into one ``hydra.run.dir`` (a CI matrix whose jobs name the same
``out``) both passed the look, both exited 0, and the directory held one run's results and
both runs' log. The claim is a marker file created with ``O_EXCL`` (the filesystem lets one
process create it), before Hydra writes anything there, and it stays: the directory is that
run's, finished or not. A run refused before it started gives its claim back
(:func:`release`), so the same command can be run again once fixed.
"""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

from omegaconf import OmegaConf

from accelopt.errors import ConfigError
from accelopt.job.checkpoint import CHECKPOINT_DIR, WEIGHTS_DIR, has_checkpoints

CLAIM_FILE = ".accelopt-run"
"""The marker of a run directory taken by a run (its content: the claiming process's id)."""

OUTPUT_NAMES = ("metrics.json", "metrics.csv", "trace.json", "timeline.png", "config.yaml",
                "per_iteration.json", WEIGHTS_DIR)
"""What a run writes into its directory (beside ``checkpoints/``, checked on its own): one
of them already there, a user's own file or an older run's, would be written over."""

_AGAIN = ("give this run another directory (hydra.run.dir / run_dir), or remove that one: "
          "results are never overwritten")

_held: set[str] = set()
"""The directories this process claimed (it may give them back: :func:`release`)."""


def refuse_taken(run_dir: Path, *, shared: bool = False, resuming: Path | None = None) -> None:
    """One line when ``run_dir`` is not free for a new run: it holds a run's results, the
    checkpoints of one that did not finish, another run's claim (one running now, or one
    stopped before it wrote its results), or a file the run would write over. ``shared``:
    the ranks of one torchrun job share the directory (for checkpoint parts), each writing
    its config and Hydra files there: only the results and checkpoints of an earlier run
    count, and not the checkpoints a peer rank of this same resume (``resuming``, else the
    ``run.resume`` of the config a rank saved there) has already carried in."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.json").exists():
        raise ConfigError(f"{run_dir} already holds a run (metrics.json); {_AGAIN}")
    if _unfinished_checkpoints(run_dir, shared, resuming):
        # a run killed outright (SIGKILL, out of memory) writes no metrics.json: its
        # checkpoints are all that is left of it, and the new run's would replace them
        raise ConfigError(f"{run_dir} holds the checkpoints of a run that did not finish; "
                          f"continue it with {resume_form(run_dir, shared)}, or give this run "
                          "another directory (hydra.run.dir / run_dir): results are never "
                          "overwritten")
    if shared:
        return
    if (run_dir / CLAIM_FILE).exists() and str(run_dir.resolve()) not in _held:
        raise ConfigError(f"{run_dir} is taken by another run (running now, or stopped before "
                          f"it wrote its results: {CLAIM_FILE}); {_AGAIN}")
    present = [name for name in OUTPUT_NAMES if (run_dir / name).exists()]
    if present:
        raise ConfigError(f"{run_dir} already holds {', '.join(present)}, which this run would "
                          f"write over; {_AGAIN}")


def resume_form(run_dir: Path, shared: bool) -> str:
    """How to continue the run stopped in ``run_dir``: a torchrun job is resumed by the
    same torchrun command, not by ``accelopt run`` (which would start one process)."""
    if shared:
        return f"the same torchrun command given run.resume={run_dir} (and a new hydra.run.dir)"
    return f"run.resume={run_dir}"


def _unfinished_checkpoints(run_dir: Path, shared: bool, resuming: Path | None) -> bool:
    """Whether ``run_dir`` holds checkpoints of a run that did not finish. Why the carried
    ones are told apart: the ranks of a torchrun resume each check the shared directory,
    and a rank that checks after a peer carried the resumed run's checkpoints in
    (``carry_checkpoints``: hard links, a copy across filesystems) would take them for an
    unfinished run's and refuse its own resume."""
    if not has_checkpoints(run_dir):
        return False
    source = resuming if resuming is not None else _saved_resume(run_dir) if shared else None
    if not shared or source is None:
        return True
    own, theirs = Path(run_dir) / CHECKPOINT_DIR, Path(source) / CHECKPOINT_DIR
    return not all(_same_checkpoint(path, theirs / path.relative_to(own))
                   for path in own.rglob("*.pt"))


def _saved_resume(run_dir: Path) -> Path | None:
    """The ``run.resume`` of the config a rank of a torchrun job saved in ``run_dir`` before
    it carried checkpoints in (``None``: none saved, or not a resume)."""
    try:
        resume = OmegaConf.select(OmegaConf.load(Path(run_dir) / "config.yaml"), "run.resume")
    except Exception:  # none there, or one that does not parse: no evidence of a carry
        return None
    return Path(str(resume)) if resume else None


def _same_checkpoint(path: Path, original: Path) -> bool:
    """Whether ``path`` is ``original`` carried in: the same file (a hard link), or a copy
    with the same bytes."""
    try:
        return path.samefile(original) or (
            path.stat().st_size == original.stat().st_size
            and filecmp.cmp(path, original, shallow=False))
    except OSError:
        return False


def claim(run_dir: Path, *, shared: bool = False, resuming: Path | None = None) -> None:
    """Take ``run_dir`` for this process's run, or one line saying why not
    (:func:`refuse_taken`; another run that claimed it first included). Idempotent within
    the process that holds it: the command line claims before Hydra writes there, and the
    run itself (``execute``) confirms it. ``resuming``: the run directory this run resumes
    (its checkpoints, carried in by a peer rank, are not an unfinished run's)."""
    run_dir = Path(run_dir)
    if str(run_dir.resolve()) in _held:
        return
    refuse_taken(run_dir, shared=shared, resuming=resuming)
    if shared:  # the ranks of one torchrun job: rank 0 alone writes the results
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        handle = os.open(run_dir / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ConfigError(f"{run_dir} is taken by another run started at the same time "
                          f"({CLAIM_FILE}); {_AGAIN}") from None
    with os.fdopen(handle, "w") as marker:
        marker.write(f"{os.getpid()}\n")
    _held.add(str(run_dir.resolve()))


def release(run_dir: Path) -> bool:
    """Give back this process's claim on ``run_dir`` (a run refused before it started):
    its marker removed; another process's claim is never touched. Returns whether this
    process held it."""
    key = str(Path(run_dir).resolve()) if Path(run_dir).exists() else ""
    if key not in _held:
        return False
    _held.discard(key)
    try:
        (Path(run_dir) / CLAIM_FILE).unlink()
    except FileNotFoundError:
        pass
    return True


def shown_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a line shows it to the user: relative to the working directory when it
    lies under it (``runs/<date>/<time>``, as the README shows, and what a user copies into
    the next command run from the same directory), else absolute. Why: the absolute form
    of the default run directory repeated the user's whole working directory."""
    try:
        full, cwd = Path(os.path.abspath(path)), Path.cwd()  # normalised: '..' is not under
    except OSError:  # the working directory was removed: nothing to be relative to
        return str(path)
    try:
        return str(full.relative_to(cwd))
    except ValueError:  # elsewhere
        return str(full)


__all__ = ["CLAIM_FILE", "OUTPUT_NAMES", "claim", "refuse_taken", "release", "shown_path"]
