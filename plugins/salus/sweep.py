"""``accelopt run -m <sweep> hydra/launcher=salus``: every run of a sweep shares one device.

Hydra's basic launcher runs a sweep's runs one after another, each alone on the device, so
the device idles through every run's set-up, profiling and output writing, and a small job
leaves most of it unused. This launcher instead submits the jobs of *every* run to one
in-process salus execution service (one executor, salus's lanes and policy), so the runs'
jobs are packed onto the device side by side, then splits the shared execution's record back
into each run's own directory: the same ``config.yaml``, ``metrics.json``, ``metrics.csv``,
``trace.json``, ``timeline.png`` and ``weights/`` as under the basic launcher, its jobs under
their own ids and names, their times on the shared clock (a run's JCTs include the time it
waited for the others: that is what packing trades). The shared execution keeps its own
record in ``<sweep dir>/salus-pack/``. A sweeper that launches its runs in batches
(``hydra.sweeper.max_batch_size``) calls the launcher once per batch: each batch is packed
on its own, into its own shared execution (:func:`pack_dir_name`), never into an earlier
batch's.

What can be packed: runs that differ only in their workload (a learning-rate sweep, a seed
sweep, a model sweep). Everything else (plugins, cluster mode, run settings) is one setting
of the one execution, so runs that differ in it are refused in one line, before anything
runs. A job's numerics depend on its own seed, not on its neighbours (per-job RNG, weights
from the job's seed), so with deterministic settings (``run.threads=1`` and
``hydra.launcher.threads=1``: one intra-op thread per lane, as per run) every run's weights
are bitwise those of the basic launcher.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from rich.markup import escape

from accelopt import ConfigError
from accelopt.atomic import atomic_open
from accelopt.runtime.resume_target import PACKED_SWEEP_DIR

PACK_DIR = PACKED_SWEEP_DIR
"""Where the shared execution's own record goes, inside the sweep directory. A killed sweep
leaves only this directory; ``run.resume`` of it trains the jobs on into one run directory
and says so (the split into the runs' directories is this launcher's, after the run)."""

EXEMPT = ("workload", "hydra")
"""Top-level keys runs may differ in (the workload) or that are Hydra's own."""


@dataclasses.dataclass
class SweepRun:
    """One run of the sweep: its task config, its output directory and Hydra's record."""

    index: int
    overrides: list[str]
    config: DictConfig
    """The full config Hydra composed (with its ``hydra`` node)."""
    task: DictConfig
    """What the run's task sees: the config without ``hydra``."""
    out_dir: Path


def pack_dir_name(first_index: int) -> str:
    """The shared execution's directory of the batch whose first run is ``first_index``:
    :data:`PACK_DIR` for the first (a sweep launched in one batch has only that one), and
    ``salus-pack-<first index>`` for a later batch. One name for every batch let each batch
    write over the one before: its metrics, trace and checkpoints lost, while the earlier
    runs' ``metrics.json`` still named it as their packed execution."""
    return PACK_DIR if first_index == 0 else f"{PACK_DIR}-{first_index}"


def batch_size_limit(runs: Sequence[SweepRun]) -> int | None:
    """``hydra.sweeper.max_batch_size`` (None where the sweeper has none, or it is unset)."""
    limit = OmegaConf.select(runs[0].config, "hydra.sweeper.max_batch_size", default=None)
    return int(limit) if limit else None


def batched(runs: Sequence[SweepRun]) -> bool:
    """Whether the sweeper launches its runs in batches (this launch is one of them)."""
    return runs[0].index > 0 or batch_size_limit(runs) is not None


def span(runs: Sequence[SweepRun]) -> str:
    """``run #3`` or ``runs #3-#5``: the runs of one launch (their indices are consecutive)."""
    first, last = runs[0].index, runs[-1].index
    return f"run #{first}" if first == last else f"runs #{first}-#{last}"


def _without(cfg: DictConfig, keys: Sequence[str]) -> dict[str, Any]:
    data = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(data, dict)
    return {k: v for k, v in data.items() if k not in keys}


def check_packable(runs: Sequence[SweepRun]) -> None:
    """Runs that differ in anything but their workload cannot share one execution, nor can
    settings the one execution would not honour (a cluster, a resume, ``run.compare``'s
    reference runs): one line naming the first such key and the fix."""
    first = _without(runs[0].task, EXEMPT)
    for run in runs[1:]:
        other = _without(run.task, EXEMPT)
        for key in sorted(set(first) | set(other)):
            if first.get(key) != other.get(key):
                raise ConfigError(
                    f"hydra/launcher=salus packs runs that differ only in their workload, but "
                    f"runs #{runs[0].index} and #{run.index} differ in '{key}' "
                    f"({' '.join(run.overrides)}); sweep only workload keys, or use Hydra's "
                    "basic launcher (drop hydra/launcher=salus)")
    task = runs[0].task
    if str(task.cluster.mode) != "none":
        raise ConfigError(
            f"hydra/launcher=salus packs runs onto one device in one process, but "
            f"cluster.mode={task.cluster.mode}; use cluster.mode=none or Hydra's basic launcher")
    if task.run.get("resume"):
        raise ConfigError("hydra/launcher=salus cannot resume runs (run.resume); resume each "
                          "run on its own")
    compare = str(task.run.get("compare", "none"))
    if compare != "none":  # the merged execution runs no reference runs: dropped unsaid
        raise ConfigError(
            f"hydra/launcher=salus runs no run.compare reference runs, but "
            f"run.compare={compare}; drop run.compare (a sweep compares its own points), "
            "or use accelopt bench, or Hydra's basic launcher (drop hydra/launcher=salus)")


Origin = dict[str, tuple[int, str, str]]
"""Merged job id -> (the run's position in the sweep, the job's id in its run, its name)."""


def merged_config(runs: Sequence[SweepRun], launcher: Any) -> tuple[DictConfig, Origin]:
    """One config whose workload holds every run's jobs (each renamed ``r<k>-<name>``, so
    names stay unique; its seed, and so its numerics, unchanged) and whose plugins include
    salus (the runs' own salus settings if they select it, else the launcher's), and the map
    from each merged job back to its run."""
    from accelopt.job import job_specs
    from accelopt.job.specs import job_id_for

    merged = copy.deepcopy(runs[0].task)
    jobs: list[Any] = []
    origin: Origin = {}
    for position, run in enumerate(runs):
        for index, spec in enumerate(job_specs(run.task)):
            renamed = dataclasses.replace(spec, name=f"r{run.index}-{spec.name}")
            origin[job_id_for(len(jobs), renamed)] = (position, job_id_for(index, spec),
                                                      spec.name)
            jobs.append(renamed)
    with open_dict(merged):
        merged.workload.jobs = [OmegaConf.structured(j) for j in jobs]
        merged.workload.generate.n_jobs = 0
        merged.run.compare = "none"
        if merged.get("plugins") is None:
            merged.plugins = {}
        if "salus" in merged.plugins:
            _refuse_two_settings(merged.plugins.salus, launcher)
        else:
            merged.plugins.salus = {"policy": str(launcher.policy),
                                    "max_lanes": lanes_for(launcher, str(merged.run.device)),
                                    "threads": int(launcher.threads)}
    return merged, origin


LAUNCHER_DEFAULTS = {"policy": "pack", "max_lanes": -1, "threads": 0}


def _refuse_two_settings(salus: Any, launcher: Any) -> None:
    """Runs that select salus themselves bring its settings; a launcher setting beside them
    that says otherwise would be silently dropped, so it is refused."""
    for key, default in LAUNCHER_DEFAULTS.items():
        asked = getattr(launcher, key, default)
        if asked != default and str(asked) != str(salus.get(key, default)):
            raise ConfigError(
                f"hydra.launcher.{key}={asked} and the runs' own +plugins=[salus] "
                f"(plugins.salus.{key}={salus.get(key, default)}) disagree; the runs' salus "
                f"settings are the ones used: set plugins.salus.{key}, or drop +plugins=[salus]")


def _check_launcher_policy(ref: str) -> None:
    """``hydra.launcher.policy`` checked under its own name: the runs' salus found it
    wrong as "plugins.salus.policy", a key the command line did not have."""
    from accelopt_plugins.salus.policies import AUTO, make_policy

    from accelopt.errors import ConfigError

    if ref == AUTO:
        return
    try:
        make_policy(ref)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("plugins.salus.policy:", "hydra.launcher.policy:",
                                           1)) from None


def _check_launcher_numbers(launcher: Any) -> None:
    """``hydra.launcher.max_lanes`` and ``.threads`` checked under their own names: the
    runs' salus found them wrong as "plugins.salus.max_lanes" / ".threads", keys the
    command line did not have (the bounds are salus's own)."""
    from accelopt.drivers.setup import MAX_THREADS, usable_cores

    lanes, threads = int(launcher.max_lanes), int(launcher.threads)
    if lanes < -1:
        raise ConfigError("hydra.launcher.max_lanes must be -1 (one lane per core on a CPU, "
                          "the policy's default on a GPU), 0 (as many as fit) or a positive "
                          f"count; got {lanes}")
    if not 0 <= threads <= MAX_THREADS:
        raise ConfigError(f"hydra.launcher.threads must be in [0, {MAX_THREADS}] (0 = auto; "
                          f"this machine has {usable_cores()} cores); got {threads}")


def lanes_for(launcher: Any, device: str) -> int:
    """``hydra.launcher.max_lanes``; its default (-1) on a CPU is one lane per core: a lane
    beyond the cores adds no compute, only threads contending for the cores and the GIL
    (16 lanes of small jobs on 2 cores ran slower than 2); elsewhere the policy's default."""
    asked = int(launcher.max_lanes)
    if asked != -1 or device.startswith("cuda"):
        return asked
    from accelopt.drivers.setup import usable_cores

    return usable_cores()


SHARED_ONLY = ("iteration", "hook")
"""Run-level span categories kept only in the shared execution's record: other jobs'
iterations, and the hooks track (every hook call of the shared execution, the launcher's
salus included: thousands of spans per run that no run made alone, which made every run's
``trace.json`` and ``timeline.png`` as large as the whole sweep's)."""


def _renamed_spans(spans: Sequence[Any], names: dict[str, str]) -> list[Any]:
    """The spans of a run's jobs (merged name -> own name), and the run-level spans that are
    not :data:`SHARED_ONLY` (telemetry)."""
    out = []
    for span in spans:
        job_name = (span.args or {}).get("job")
        if job_name in names:
            own = names[job_name]
            out.append(dataclasses.replace(span, name=span.name.replace(job_name, own),
                                           args={**span.args, "job": own}))
        elif job_name is None and span.category not in SHARED_ONLY:
            out.append(span)
    return out


def split_record(record: Any, runs: Sequence[SweepRun], origin: Origin,
                 shared: Path) -> list[Any]:
    """Each run's share of the shared execution's record: its jobs under their own ids and
    names, the spans of its jobs, the run-level rows and telemetry of the shared run."""
    from accelopt.records import RunRecord

    parts: list[RunRecord] = []
    for position, run in enumerate(runs):
        names: dict[str, str] = {}
        results = []
        for result in record.jobs:
            run_pos, own_id, name = origin[result.job.job_id]
            if run_pos != position:
                continue
            names[result.job.name] = name
            job = dataclasses.replace(result.job, job_id=own_id, name=name)
            results.append(dataclasses.replace(result, job=job))
        info = dataclasses.replace(record.info, run_dir=str(run.out_dir),
                                   jobs=tuple(r.job for r in results))
        metrics = {**record.metrics, "packed_runs": len(runs),
                   "packed_execution": str(shared)}
        parts.append(RunRecord(info=info, duration_s=record.duration_s, jobs=results,
                               spans=_renamed_spans(record.spans, names),
                               plugin_rows=list(record.plugin_rows),
                               telemetry=list(record.telemetry),
                               telemetry_note=record.telemetry_note, metrics=metrics))
    return parts


def _copy_job_files(shared: Path, run_dir: Path, renames: dict[str, str],
                    own_specs: dict[str, Any], own_plugins: dict[str, Any] | None) -> None:
    """``weights/`` and ``checkpoints/`` of a run's jobs, under their own ids. A checkpoint
    records its job's spec and its run's plugin settings, which ``run.resume`` compares
    with the run's own: the merged job's (renamed ``r<k>-<name>``) and the merged run's
    (the launcher's salus among them) are replaced by the run's, or no run of a packed
    sweep could be resumed ("written for a different job spec", "written with other
    plugin settings")."""
    import torch

    from accelopt.job.checkpoint import PLUGIN_SETTINGS, save_checkpoint

    for folder in ("weights", "checkpoints"):
        for merged_id, own_id in renames.items():
            source = shared / folder / f"{merged_id}.pt"
            if not source.exists():
                continue
            (run_dir / folder).mkdir(parents=True, exist_ok=True)
            if folder == "weights":
                shutil.copy2(source, run_dir / folder / f"{own_id}.pt")
                continue
            state = torch.load(source, map_location="cpu", weights_only=False)
            state["spec"] = dataclasses.asdict(own_specs[own_id])
            # None (the run's settings cannot be written out): a resume leaves them unchecked
            state[PLUGIN_SETTINGS] = own_plugins
            save_checkpoint(state, run_dir / folder / f"{own_id}.pt")


def _write_log(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


def write_run(run: SweepRun, part: Any, shared: Path, renames: dict[str, str]) -> None:
    """A run directory as the basic launcher's run would leave it; its ``accelopt.log``
    holds its own summary tables (the shared execution's are in the pack's log)."""
    import io

    from rich.console import Console

    from accelopt.report import render_summary, run_metrics, write_run_outputs
    from accelopt.runtime.run_dir import claim

    claim(run.out_dir)  # the run's directory is taken, as a run under the basic launcher takes it
    with atomic_open(run.out_dir / "config.yaml") as handle:
        handle.write(OmegaConf.to_yaml(run.task, resolve=True))
    hydra_dir = run.out_dir / ".hydra"
    hydra_dir.mkdir(exist_ok=True)
    OmegaConf.save(run.task, hydra_dir / "config.yaml", resolve=False)
    # Hydra's own record of the run (its job, runtime and sweep settings), as the basic
    # launcher leaves it beside the other two
    OmegaConf.save(OmegaConf.create({"hydra": run.config.hydra}), hydra_dir / "hydra.yaml",
                   resolve=False)
    OmegaConf.save(OmegaConf.create(list(run.overrides)), hydra_dir / "overrides.yaml")
    part.summary = run_metrics(part)
    write_run_outputs(part, run.out_dir)
    from accelopt.job import job_specs
    from accelopt.job.checkpoint import plugin_settings
    from accelopt.job.specs import job_id_for

    own_specs = {job_id_for(k, spec): spec for k, spec in enumerate(job_specs(run.task))}
    _copy_job_files(shared, run.out_dir, renames, own_specs, plugin_settings(run.task))
    log = Console(file=io.StringIO(), width=120, record=True)
    render_summary(part, log)
    log.print(f"packed by hydra/launcher=salus with {part.metrics['packed_runs']} runs; "
              f"times are on the shared execution's clock; its hook calls (the hooks track) "
              f"are in its own record: {shared}")
    _write_log(run.out_dir / "accelopt.log", log.export_text())


def execute_packed(runs: Sequence[SweepRun], launcher: Any, sweep_dir: Path,
                   console: Any = None) -> list[Any]:
    """Run every run's jobs in one salus execution; write each run's directory; return each
    run's record (its share). A Ctrl-C or SIGTERM ends it in one line saying where what ran
    is kept and how to go on (:func:`interrupted_pack_line`), exit 130 (143)."""
    from accelopt.plugin import Registry
    from accelopt.report.console import default_console
    from accelopt.runtime.run import error_line, execute

    console = console or default_console(record=True)
    merged, origin = merged_config(runs, launcher)
    shared = sweep_dir / pack_dir_name(runs[0].index)
    started = time.perf_counter()
    written: list[SweepRun] | None = None
    """The runs whose directories were written; None while the shared execution runs."""
    try:
        try:
            record = execute(merged, run_dir=shared, registry=Registry.discover(),
                             console=console)
        finally:
            if shared.is_dir():
                _write_log(shared / "accelopt.log", console.export_text(clear=True))
        parts = split_record(record, runs, origin, shared)
        written = []
        for position, (run, part) in enumerate(zip(runs, parts, strict=True)):
            renames = {merged_id: own_id
                       for merged_id, (run_pos, own_id, _name) in origin.items()
                       if run_pos == position}
            write_run(run, part, shared, renames)
            written.append(run)
    except KeyboardInterrupt as exc:  # Terminated (SIGTERM) included
        print(interrupted_pack_line(error_line(exc), runs, shared, sweep_dir, written),
              file=sys.stderr)
        raise SystemExit(getattr(exc, "exit_code", 130)) from None
    seconds = time.perf_counter() - started
    console.print(f"[dim]{escape(packed_line(runs, len(record.jobs), seconds, shared))}[/dim]")
    return parts


def packed_line(runs: Sequence[SweepRun], jobs: int, seconds: float, shared: Path) -> str:
    """What one launch packed, and, where the sweeper launches in batches, that runs were
    packed only within a batch (a sweep of 8 runs in batches of 2 is 4 executions of 2)."""
    if not batched(runs):
        return (f"salus launcher: {len(runs)} runs, {jobs} jobs packed onto one device in "
                f"{seconds:.1f} s; each run's outputs in its own directory, the shared "
                f"execution in {shared}")
    limit = batch_size_limit(runs)
    why = f" (hydra.sweeper.max_batch_size={limit})" if limit else ""
    return (f"salus launcher: {span(runs)} ({jobs} jobs) packed onto "
            f"one device in {seconds:.1f} s; each run's outputs in its own directory, this "
            f"batch's shared execution in {shared}: the sweeper launches its runs in batches"
            f"{why}, so runs are packed per batch{f' of up to {limit}' if limit else ''}, "
            "each batch in its own shared execution")


def interrupted_pack_line(error: str, runs: Sequence[SweepRun], shared: Path,
                          sweep_dir: Path, written: Sequence[SweepRun] | None) -> str:
    """The line a sweep stopped by Ctrl-C or SIGTERM in a packed execution ends with, as
    the basic launcher's (``stopped_line`` and ``interrupted_sweep_note``): where what ran
    is kept, the ``run.resume`` command where the shared execution wrote checkpoints, and
    which runs had ended. A bare "interrupted" left a user to look for them."""
    from accelopt.cli.hydra_run import stopped_line

    what = span(runs)
    if written is None:  # in the shared execution: its record, not split into the runs
        line = stopped_line(error, shared) or f"{error} before {shared} held anything"
        line += (f"; the sweep stopped in the packed execution of {what}: it is not split "
                 "into their run directories (a resume trains their jobs on into one new "
                 "directory, job r<k>-<name> being run k's)")
        again = what
    else:
        done = [r.index for r in written]
        left = [f"#{r.index}" for r in runs if r.index not in done]
        line = (f"{error} after the packed execution of {what} ended, while it was split "
                f"into their run directories: the whole record is in {shared}; "
                f"{', '.join(f'#{i}' for i in done) or 'none'} written, not "
                f"{', '.join(left)}")
        again = f"run{'s' if len(left) > 1 else ''} {', '.join(left)}"
    first = runs[0].index
    if first > 0:
        earlier = "run #0" if first == 1 else f"runs #0-#{first - 1}"
        line += f"; {earlier} ended before it (kept in {sweep_dir})"
    if batched(runs):
        line += ", and any later batch did not run"
        again += " and any later batch"
    return (f"{line}; for their own run directories, sweep {again} again with a new "
            "hydra.sweep.dir (a directory holding a sweep's runs is not written into again)")


def discard_unstarted_sweep_dir(sweep_dir: Path) -> None:
    """A refused sweep leaves nothing behind: Hydra's sweeper wrote ``multirun.yaml`` into the
    sweep directory before the launcher could refuse."""
    leftovers = list(sweep_dir.iterdir()) if sweep_dir.is_dir() else []
    if all(p.name == "multirun.yaml" for p in leftovers):
        for p in leftovers:
            p.unlink()
        try:
            sweep_dir.rmdir()
        except OSError:
            pass


class ValidatedConfigs:
    """The sweep configs Hydra's sweeper composes to validate a batch, kept for the launch.

    Hydra's sweeper composes every run of a batch (``validate_batch_is_legal``) and throws
    the configs away; a launcher then composes each run again with the same arguments (one
    composition of accelopt's config is ~0.1 s, so 0.8 s of an 8-run sweep's ~20 s). This
    wraps the Hydra run's config loader (an instance attribute, for the one Hydra run the
    launcher belongs to) so the launcher takes the sweeper's config instead of composing
    it again; a run it has none of (another sweeper, no validation) is composed as before.
    """

    def __init__(self, loader: Any) -> None:
        self.compose = loader.load_sweep_config
        self.kept: dict[tuple[int, tuple[str, ...]], DictConfig] = {}
        loader.load_sweep_config = self._composed_and_kept

    def _composed_and_kept(self, master_config: DictConfig,
                           sweep_overrides: list[str]) -> DictConfig:
        config = self.compose(master_config=master_config, sweep_overrides=sweep_overrides)
        self.kept[(id(master_config), tuple(sweep_overrides))] = config
        return config

    def take(self, master_config: DictConfig, overrides: Sequence[str]) -> DictConfig:
        """The run's composed config (the sweeper's if it made one: nobody else holds it)."""
        kept = self.kept.pop((id(master_config), tuple(overrides)), None)
        if kept is not None:
            return kept
        return self.compose(master_config=master_config, sweep_overrides=list(overrides))


def _summarise(sweep_dir: Path, runs: Sequence[SweepRun], parts: Sequence[Any] | None,
               errors: Sequence[str], code: Any = None) -> None:
    """The packed sweep's ``sweep.json``, as the basic launcher writes it
    (``accelopt.cli.sweep_summary``), and its line. ``parts``: each run's record, where the
    packed execution ended; None where it failed (``code``: its exit code; each run's error
    is the execution's) or was stopped (``errors`` empty: each run interrupted). The points
    of the sweep's earlier batches (a sweeper launching in batches) stay in the file."""
    from accelopt.cli.hydra_run import most_severe
    from accelopt.cli.sweep_summary import (
        SweepPoint,
        point_status,
        points_written,
        run_dir_shown,
        write_and_say,
    )
    from accelopt.errors import JobsUnfinished
    from accelopt.runtime.compare import inert_plugins

    ended = parts is not None
    stopped = not ended and not any(errors)
    points = [p for p in points_written(sweep_dir) if p.point not in {r.index for r in runs}]
    for position, (run, error) in enumerate(zip(runs, errors, strict=True)):
        part = parts[position] if parts is not None else None
        exit_code = (JobsUnfinished.exit_code if error else 0) if ended else int(code or 1)
        info = getattr(part, "info", None)
        inert = inert_plugins(info.plugins, part.plugin_rows) if info is not None else []
        points.append(SweepPoint(
            point=run.index, overrides=list(run.overrides),
            run_dir=run_dir_shown(sweep_dir, run.out_dir),
            status=point_status(exit_code, error, stopped), exit_code=exit_code,
            error=error or None, inert_plugins=list(inert)))
    points.sort(key=lambda p: p.point)
    write_and_say(sweep_dir, points, complete=ended, launcher="salus",
                  exit_code=most_severe([p.exit_code for p in points]), say_where=True)


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]],
           initial_job_idx: int) -> list[Any]:
    """The launcher's work (``SalusLauncher.launch``): compose every run as the basic
    launcher does (or take the config the sweeper composed for it: :class:`ValidatedConfigs`),
    refuse what cannot be packed (one line, exit 2), run, and answer Hydra one ``JobReturn``
    per run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import JobReturn, JobStatus, setup_globals

    from accelopt.cli.hydra_run import sweep_failures, unfinished_jobs
    from accelopt.errors import AccelOptError, JobsUnfinished

    setup_globals()
    config = launcher.config
    sweep_dir = Path(str(config.hydra.sweep.dir))
    runs: list[SweepRun] = []
    for offset, overrides in enumerate(job_overrides):
        index = initial_job_idx + offset
        sweep_config = launcher.validated.take(config, overrides)
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = index
            sweep_config.hydra.job.num = index
        HydraConfig.instance().set_config(sweep_config)
        out_dir = sweep_dir / str(sweep_config.hydra.sweep.subdir)
        task = copy.deepcopy(sweep_config)
        with open_dict(task):
            del task["hydra"]
        runs.append(SweepRun(index, list(overrides), sweep_config, task, out_dir))
    try:
        _check_launcher_policy(str(launcher.policy))
        _check_launcher_numbers(launcher)
        check_packable(runs)
        parts = execute_packed(runs, launcher, sweep_dir)
    except AccelOptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        discard_unstarted_sweep_dir(sweep_dir)
        if sweep_dir.is_dir():  # it ran, and failed: each of its runs said so in sweep.json
            _summarise(sweep_dir, runs, None, [str(exc)] * len(runs), code=exc.exit_code)
        raise SystemExit(exc.exit_code) from None
    except SystemExit as stop:  # Ctrl-C or SIGTERM (execute_packed said where things are)
        _summarise(sweep_dir, runs, None, [""] * len(runs), code=stop.code)
        raise
    returns, errors = [], []
    for run, part in zip(runs, parts, strict=True):
        ret = JobReturn(overrides=run.overrides, cfg=run.task, hydra_cfg=run.config,
                        working_dir=str(run.out_dir), task_name=str(config.hydra.job.name))
        ret.status = JobStatus.COMPLETED
        ret.return_value = part
        returns.append(ret)
        errors.append(unfinished_jobs(part, run.out_dir))
    _summarise(sweep_dir, runs, parts, errors)
    if any(errors):  # as the basic launcher ends such a sweep: each run's line, which
        # failed, a non-zero exit (a CI sweep whose jobs failed read as passing)
        for line in filter(None, errors):
            print(f"error: {line}", file=sys.stderr)
        closing = sweep_failures(errors)
        if closing:
            print(f"error: {closing}", file=sys.stderr)
        raise SystemExit(JobsUnfinished.exit_code)
    return returns
