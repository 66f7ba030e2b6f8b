"""Where a run or a sweep's points write, checked before Hydra writes there: named
directories resolved as Hydra resolves them, two points of a sweep in one directory
refused, a single run's directory claimed, a torchrun secondary rank's scratch directory,
and a refused run's own files removed so the fixed command can run again."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf, open_dict

from accelopt.atomic import RUNS_DIR
from accelopt.cli.config_errors import HYDRA_PASSTHROUGH_FLAGS
from accelopt.errors import ConfigError
from accelopt.job.checkpoint import has_checkpoints
from accelopt.runtime.run_dir import CLAIM_FILE, claim, refuse_taken, release


def named_dir(overrides: Sequence[str], key: str) -> str | None:
    """The value the overrides give ``key`` (``hydra.run.dir``, ``hydra.sweep.dir``), the
    last one, as given; None when they give none."""
    named = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"{key}=")]
    return named[-1] if named else None


def refuse_one_directory_for_two_points(where: Sequence[PointDirs | None]) -> None:
    """Two points of a sweep whose directories resolve to one (a ``hydra.sweep.subdir``
    without ``${hydra.job.num}``, the default's: ``fixed``, ``${workload.name}`` in a seed
    sweep): each point wrote over the one before, exit 0, only the last point's results
    left. Checked as each point is composed, against the points before it: the sweep is
    refused before anything runs. A point whose directory resolves only once Hydra runs is
    checked then (:func:`run_hydra`)."""
    latest = where[-1]
    if latest is None or latest.point is None:
        return
    mine = os.path.abspath(latest.point)
    for earlier, dirs in enumerate(where[:-1]):
        if dirs is not None and dirs.point is not None and os.path.abspath(dirs.point) == mine:
            raise ConfigError(shared_directory_line(earlier, len(where) - 1, latest.point,
                                                    latest.subdir))


def shared_directory_line(earlier: int, later: int, directory: str, subdir: str) -> str:
    """The line refusing sweep point ``later`` whose directory is point ``earlier``'s."""
    example = f"{subdir}_${{hydra.job.num}}" if subdir else "${hydra.job.num}"
    return (f"points #{earlier} and #{later} of the sweep both write to {directory} "
            f"(hydra.sweep.subdir={subdir}), each over the one before; make "
            f"hydra.sweep.subdir differ per point: include ${{hydra.job.num}} (e.g. "
            f"hydra.sweep.subdir={example}) or drop it")


def refuse_taken_sweep_dir(sweep_dir: Path) -> None:
    """A named ``hydra.sweep.dir`` that already holds files is refused before the sweep:
    Hydra numbers a sweep's runs from 0 again, so a second sweep into the same directory
    wrote its runs over the first one's (a fixed directory is how CI collects artifacts)."""
    if sweep_dir.is_dir() and any(sweep_dir.iterdir()):
        raise ConfigError(f"hydra.sweep.dir {sweep_dir} already holds files (an earlier "
                          "sweep's runs?); give this sweep another directory, or remove that "
                          "one: results are never overwritten")


def refuse_taken_run_dir(run_dir: Path) -> None:
    """A run directory that already holds a run (its results, the checkpoints of one killed
    before it wrote them, another run's claim: :mod:`accelopt.runtime.run_dir`) or a file the
    run would write is refused before Hydra writes into it: the new run's files would land
    beside the old run's and over the rest. Results are never overwritten. The ranks of one
    torchrun job share their directory: there only an earlier run's results count."""
    from accelopt.drivers.processes import under_torchrun

    refuse_taken(run_dir, shared=under_torchrun())


SAFE_PATH = re.compile(r"[\w./:@%+~-]+")
"""A directory an override can give unquoted (:func:`pin_run_dir`)."""


def pin_run_dir(args: list[str], resolved: str | None) -> list[str]:
    """``args`` with its ``hydra.run.dir`` (one with a ``${...}`` in it, which
    :func:`prepare` resolved against the composed config to ``resolved``) replaced by that
    directory, so the directory checked, the one :func:`claim_named_run_dir` claims before
    Hydra writes, and the one Hydra writes into are one (a ``${now:...}`` in it included).
    Unchanged when there is none or it cannot be given unquoted."""
    if not resolved or not SAFE_PATH.fullmatch(resolved):
        return args
    at = max(i for i, a in enumerate(args) if a.lstrip("+").startswith("hydra.run.dir="))
    plus = args[at][:len(args[at]) - len(args[at].lstrip("+"))]
    return [*args[:at], f"{plus}hydra.run.dir={resolved}", *args[at + 1:]]


def claim_named_run_dir(args: list[str]) -> Path | None:
    """The ``hydra.run.dir`` a single run names, claimed before Hydra writes its ``.hydra/``
    files and log there (:func:`accelopt.runtime.run_dir.claim`): a second run started into
    it meanwhile is refused in one line, the first run's files untouched. ``None``: a sweep,
    a command that runs nothing (``--cfg``), or the default directory (claimed by the run)."""
    from accelopt.drivers.processes import under_torchrun

    if any(a in ("-m", "--multirun") or a.split("=")[0] in HYDRA_PASSTHROUGH_FLAGS
           for a in args):
        return None
    named = named_dir(args, "hydra.run.dir")
    if named is None or "$" in named:
        return None
    run_dir = Path(named)
    claim(run_dir, shared=under_torchrun())
    return run_dir


class PointDirs(NamedTuple):
    """Where one composed run (a sweep's point) writes, resolved as Hydra resolves it when
    the run starts (its ``${...}`` against the composed config, ``${hydra.job.num}`` the
    point's number); ``None`` where a value does not resolve before Hydra runs."""

    run: str | None
    """``hydra.run.dir`` (a single run's directory)."""
    sweep: str | None
    """``hydra.sweep.dir`` (a sweep's, holding ``multirun.yaml``)."""
    point: str | None
    """``hydra.sweep.dir``/``hydra.sweep.subdir``: the point's own directory in a sweep."""
    subdir: str
    """``hydra.sweep.subdir`` as given (for the line refusing it)."""


def point_dirs(cfg: DictConfig, job_num: int, clock: DictConfig | None) -> PointDirs:
    """The directories of a config composed with its ``hydra`` node, for sweep point
    ``job_num``, resolved as Hydra's launcher and ``run_job`` do (``hydra.job.num`` and ``id``
    set, ``HydraConfig`` set for ``${hydra:...}``), so a directory can be checked before
    Hydra writes into it (a ``${workload.name}`` in it was taken literally, and a directory
    holding a run was written over)."""
    from hydra.core.hydra_config import HydraConfig

    with open_dict(cfg):
        cfg.hydra.job.num = job_num
        cfg.hydra.job.id = job_num
    if clock is not None:
        OmegaConf.copy_cache(from_config=clock, to_config=cfg)
    subdir = str(OmegaConf.to_container(cfg.hydra.sweep, resolve=False).get("subdir"))
    saved = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(cfg)
        run, sweep, sub = (_resolved(cfg, key) for key in
                           ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir"))
    finally:
        HydraConfig.instance().cfg = saved
    if clock is not None:
        OmegaConf.copy_cache(from_config=cfg, to_config=clock)
    point = os.path.join(sweep, sub) if sweep is not None and sub is not None else None
    return PointDirs(run, sweep, point, subdir)


def _resolved(cfg: DictConfig, key: str) -> str | None:
    try:
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except Exception:  # noqa: BLE001 - resolvable only once Hydra runs: Hydra's to check
        return None
    return None if value is None else str(value)


def secondary_rank_dir(args: list[str], env: dict[str, str] | None = None) -> str | None:
    """Under torchrun, a rank other than 0 writes no outputs (rank 0 gathers them): unless
    the command names a ``hydra.run.dir`` (then every rank shares it, e.g. for checkpoint
    parts), such a rank's Hydra directory is a temporary one, removed when it ends, so a
    machine's ``runs/`` gets no directory per rank holding only a config."""
    import tempfile

    from accelopt.drivers.processes import SCRATCH_PREFIX, under_torchrun

    env = dict(os.environ) if env is None else env
    if not under_torchrun(env) or env["RANK"] == "0":
        return None
    if named_dir(args, "hydra.run.dir") is not None:
        return None
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{env['RANK']}-")


def remove_if_never_started(run_dir: Path) -> bool:
    """A run refused before it started (a user error found by the up-front validation)
    leaves no run directory behind. Only what Hydra itself wrote there is removed (its
    ``.hydra/`` and its still empty job log ``accelopt.log``), and the directory only if that
    leaves it empty: never a user's directory with anything else in it, never one that holds
    a run's outputs. Its claim is given back (the command can be run again once fixed)
    unless the run wrote results or checkpoints: one that started and failed (exit 3: a
    diverged job) lost its claim, which says the directory is a run's. Every file may go
    while this looks: the ranks of one torchrun launch refused alike share the directory and
    each removes it (a missing file is one removed already, not a failure of this one)."""
    if not run_dir.is_dir():
        return True
    if not (run_dir / "metrics.json").exists() and not has_checkpoints(run_dir):
        release(run_dir)
    try:
        entries = [p for p in run_dir.iterdir() if p.name != CLAIM_FILE]
        hydra_own = [p for p in entries if p.name == ".hydra" and p.is_dir()
                     or p.name == "accelopt.log" and p.is_file() and p.stat().st_size == 0]
    except FileNotFoundError:  # removed by another process meanwhile
        return not run_dir.exists()
    if len(hydra_own) != len(entries):
        return False
    for path in hydra_own:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    try:
        run_dir.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    _remove_empty_default_parents(run_dir)
    return True


def _remove_empty_default_parents(run_dir: Path) -> None:
    """The default ``runs/<date>/<time>``'s ``runs/<date>`` (and ``runs``) left empty by the
    removal of a refused run's directory: a refused command leaves nothing behind."""
    try:
        runs = (Path.cwd() / RUNS_DIR).resolve()
    except OSError:  # the working directory was the run directory, now removed
        return
    parent = run_dir.resolve().parent
    while parent == runs or runs in parent.parents:
        try:
            parent.rmdir()  # only if empty: another run's directory keeps it
        except OSError:
            return
        parent = parent.parent
