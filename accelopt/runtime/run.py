"""A run: validate everything the config selects, then drive the workload under the active
plugins and write the outputs.

This is the only place that wires the pieces together (plugins, jobs, driver, telemetry,
checkpoints, report); each piece stays ignorant of the others. The order, in every mode:

1. validate: the jobs, the cluster settings, and every plugin set the run will activate (the
   run's own and each ``run.compare`` reference set), each configured once: a mistake is one
   line, exit 2, before anything is trained;
2. the ``run.compare`` reference runs, if any;
3. this run: one process (``LocalDriver``: the executor and its lanes) or a cluster
   (``run_cluster``: every rank walks the same lifecycle in its own process).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from accelopt.activation import PluginSet, activate, selected_plugins
from accelopt.atomic import OutputUnwritable, atomic_open
from accelopt.collector import collector_paused, run_starts
from accelopt.config import RunSettings
from accelopt.drivers.cluster.launch import refusals_said_at_rendezvous
from accelopt.drivers.cluster.settings import (
    MAX_TIMEOUT_S,
    check_numbers,
    local_info,
    positive_number,
    unused_settings,
)
from accelopt.drivers.lifecycle import Lifecycle
from accelopt.drivers.local import Executor
from accelopt.drivers.processes import preloads_dynamo, torchrun_rank, under_torchrun
from accelopt.drivers.rows import stopped_report, with_placeholders
from accelopt.drivers.setup import (
    MAX_THREADS,
    capacity_warning,
    memory_capacity,
    pick_device,
    rank_threads,
    setup_torch,
    torch_threads,
    usable_cores,
)
from accelopt.errors import (
    AccelOptError,
    ConfigError,
    PluginHookError,
    RankFailed,
    Terminated,
    UserError,
    error_text,
    first_line,
    raised_by_hook,
)
from accelopt.host import HookTrace, hook_spans
from accelopt.job import build_jobs, job_id_for, job_specs
from accelopt.job.checkpoint import (
    CHECKPOINT_DIR,
    Checkpointer,
    has_checkpoints,
    plugin_settings,
    restore,
)
from accelopt.job.exchange import BUILD_ONLY
from accelopt.job.job import Job, check_precision
from accelopt.job.profile import measure_profile
from accelopt.job.quality import score_result
from accelopt.job.specs import job_info, spec_warnings
from accelopt.plugin import Registry, resolve
from accelopt.records import JobResult, RunRecord, Span
from accelopt.report import JobProgress, render_summary, run_metrics, write_run_outputs
from accelopt.report.console import default_console
from accelopt.report.renderer import TimelineRenderer, drawing_process
from accelopt.report.timeline_png import import_matplotlib
from accelopt.runtime import compare
from accelopt.runtime.resume_target import (
    CONFIG_FILE,
    carry_checkpoints,
    honoured,
    packed_sweep_note,
    references_unfinished,
    refuse_finished,
    resume_target,
    run_config,
)
from accelopt.runtime.run_dir import OUTPUT_NAMES, claim, release, shown_path
from accelopt.telemetry import TelemetrySampler
from accelopt.telemetry.sampler import MIN_INTERVAL_S
from accelopt.types import ReportRow, RunInfo
from accelopt.watchdog import watching


def execute(
    cfg: DictConfig,
    *,
    run_dir: Path,
    registry: Registry | None = None,
    console: Console | None = None,
    overrides: Sequence[str] | None = None,
) -> RunRecord:
    """Run the configured workload; return what it measured (outputs already written).
    ``overrides``: the command line ``cfg`` was composed from (default: Hydra's, under
    ``accelopt run``): a resumed run takes the settings it honours from there."""
    run_starts()  # the command's imports are done: frozen, the collector on (collector.py)
    console = console or default_console()
    registry = registry or Registry.discover()
    with refusals_said_at_rendezvous(cfg):  # a torchrun rank's peers stop at once with it
        refuse_torchrun_without_cluster(cfg)  # before anything is read, claimed or written
        cfg, resume_from = _maybe_resume(cfg, run_dir, console, overrides)
        reference_sets = _reference_sets(cfg, console)
        validate(cfg, registry, reference_sets)
        named = _command_line() if overrides is None else list(overrides)
        warnings = setting_warnings(cfg, named)  # said now, and kept in the run's record
        for line in warnings:
            console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
        compare.refuse_taken_references(run_dir, reference_sets)  # before any write, too
        # one run per directory, before any write (a peer rank's carried checkpoints aside)
        claim(run_dir, shared=under_torchrun(), resuming=resume_from)
    if not reference_sets:  # none run: its config must not read as a run stopped in them
        cfg = _without_compare(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    _save_config(cfg, run_dir)  # before the references: a run stopped in them is resumable
    refs: dict[str, RunRecord] = {}
    try:
        refs = compare.run_references(cfg, reference_sets, run_dir, registry, console)
        if refs:  # they ended: a resume continues this run's own jobs, without them
            cfg = _without_compare(cfg)
            _save_config(cfg, run_dir)
        if resume_from is not None:  # before anything can fail: this directory can be resumed
            carry_checkpoints(resume_from / CHECKPOINT_DIR, run_dir / CHECKPOINT_DIR)
        if cfg.cluster.mode != "none":
            return _execute_cluster(cfg, run_dir, registry, console, refs, resume_from,
                                    warnings)
        return _execute_local(cfg, run_dir, registry, console, refs, resume_from, warnings)
    except AccelOptError as exc:
        if isinstance(exc, UserError):
            _give_back_if_nothing_ran(run_dir)
        compare.references_kept(exc, run_dir, list(refs))  # its line says where they are
        raise


def refuse_torchrun_without_cluster(cfg: DictConfig) -> None:
    """Refuse ``cluster.mode=none`` in a torchrun launch of several processes. Why: each
    process then ran every job on its own, all of them into the one run directory, each
    printing its table, the last writer's files winning, and the command exited 0. One
    process (WORLD_SIZE=1) is a plain run and stays allowed."""
    if str(cfg.cluster.mode) != "none" or not under_torchrun():
        return
    _, world = torchrun_rank()
    if world > 1:
        raise ConfigError(
            f"cluster.mode=none under torchrun: each of its {world} processes would run "
            "every job on its own, into the same run directory; set cluster.mode=ps or "
            "cluster.mode=allreduce (cluster.workers, cluster.servers to match the processes), "
            "or run without torchrun")


def _give_back_if_nothing_ran(run_dir: Path) -> None:
    """A run refused as it built its jobs (a model with nothing to train, a plugin refusing
    the model) wrote only its config: that file, and its claim, are removed, so the same
    command runs again once fixed (kept, the config refused the fixed rerun as "would write
    over"). Anything else a run writes (results, checkpoints, a reference run's directory)
    keeps the directory the run's."""
    written = [name for name in OUTPUT_NAMES if name != CONFIG_FILE and (run_dir / name).exists()]
    if written or has_checkpoints(run_dir) or any(run_dir.glob("compare/*/metrics.json")):
        return
    (run_dir / CONFIG_FILE).unlink(missing_ok=True)
    release(run_dir)


def validate(cfg: DictConfig, registry: Registry,
             reference_sets: list[tuple[str, ...]] = ()) -> None:
    """Everything that can be checked before a job runs: the jobs, the cluster settings, and
    each plugin set (this run's and every reference set's) activated and configured once.
    With reference sets, each set with plugins also builds its jobs
    (:func:`_refuse_unbuildable`)."""
    ids = _validate_settings(cfg)
    for subset in [None, *reference_sets]:
        subset_cfg = cfg if subset is None else compare.subset_config(cfg, subset)
        plugins = activate(subset_cfg, registry, ids)
        if reference_sets and subset != ():
            _refuse_unbuildable(subset_cfg, plugins)


def _refuse_unbuildable(cfg: DictConfig, plugins: PluginSet) -> None:
    """Build the jobs of ``cfg`` under ``plugins`` (its model, each layer offered to
    ``accelopt_layer_build``, its optimizer to ``accelopt_optimizer_build``) and drop them,
    training nothing: a plugin's refusal of a job as it is built is raised here, one line.
    Why: the ``run.compare`` reference runs train before this run, so without it a set
    whose plugin refuses a job as it is built (its optimizer, its layers) is refused only
    after the runs before it have trained. Once per set with plugins, in this process, on
    the run's device, as the run builds them (:func:`_execute_local`); not for a cluster
    run (its ranks build their jobs with their exchanges and roles)."""
    if cfg.cluster.mode != "none":
        return
    device = pick_device(str(cfg.run.device))
    jobs = build_jobs(job_specs(cfg), device, plugins,
                      bucket_bytes=local_info(cfg.cluster).bucket_bytes)
    del jobs
    if device.type == "cuda":  # the built models' memory: not held as the runs start
        torch.cuda.empty_cache()


def refused_sets(cfg: DictConfig, registry: Registry,
                 sets: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """Each of ``sets`` that ``accelopt run`` would refuse under ``cfg`` (composed with
    every plugin of ``sets`` selected, so each plugin's own settings are in it), with the
    one-line refusal: the checks of :func:`validate`, per set, without running anything.
    A mistake in the settings every set shares (jobs, cluster) is raised, not returned."""
    ids = _validate_settings(cfg)
    refused: dict[tuple[str, ...], str] = {}
    # one copy of the configuration, each set only changing its plugins, and one job: a
    # job-scoped plugin is configured with the same arguments for every job. A copy and
    # five jobs per set took 65 ms a set, a minute for the 1,024 sets of every plugin.
    work = compare.subset_config(cfg, ())
    plugins = cfg.get("plugins") or {}
    for subset in sets:
        work.plugins = {name: plugins[name] for name in subset}
        try:
            activate(work, registry, ids[:1])
        except AccelOptError as exc:
            refused[subset] = str(exc)
    return refused


def setting_warnings(cfg: DictConfig, named: Sequence[str] = ()) -> list[str]:
    """One line each for settings that would make this run's figures read as something they
    are not. Settings its mode does not read (:func:`unused_settings` for ``cluster.*``,
    :func:`_unread_in_a_cluster` for ``run.*``; ``named``: the command line's overrides).
    And ``run.threads`` beyond the
    cores this process may use: the threads take turns on the cores, every op pays for it,
    and the run's times measure the oversubscription. A one-process run's
    ``run.memory_capacity`` beyond the device's memory (it admits jobs against it). And each
    job's training settings it cannot use as written
    (:func:`~accelopt.job.specs.spec_warnings`)."""
    lines = []
    threads, cores = int(cfg.run.threads), usable_cores()
    if threads > cores:
        lines.append(f"run.threads={threads} is more than the {cores} cores this process may "
                     f"use: its threads take turns on them, so every op is slower and the "
                     f"times measure that; run.threads={cores} or less (0: torch's default)")
    unused = unused_settings(cfg.cluster)
    if unused is not None:
        lines.append(unused)
    if cfg.cluster.mode != "none":
        lines += _unread_in_a_cluster(cfg, named)
    else:
        capacity = capacity_warning(str(cfg.run.memory_capacity), pick_device(str(cfg.run.device)))
        if capacity is not None:
            lines.append(capacity)
    try:
        specs = job_specs(cfg)
    except ConfigError:  # the run's validation names it
        specs = []
    for spec in specs:
        lines += spec_warnings(spec)
    return lines


def _unread_in_a_cluster(cfg: DictConfig, named: Sequence[str]) -> list[str]:
    """The ``run.*`` settings a cluster run does not read, when set. ``run.memory_capacity``:
    jobs are not memory-profiled there (every rank keeps every job resident), so a capacity
    that a one-process run would enforce, rejecting a job that does not fit, admits
    everything. ``run.telemetry_interval_s``: no samples are taken (each rank's timeline is
    in trace.json). ``run.progress=true`` asked for on the command line: a cluster run shows
    no progress bars (its default is true, so only when asked for)."""
    mode = cfg.cluster.mode
    lines = []
    if str(cfg.run.memory_capacity) != "auto":
        lines.append(f"run.memory_capacity={cfg.run.memory_capacity} has no effect: "
                     f"cluster.mode={mode} does not profile jobs' memory (every "
                     "rank keeps every job resident), so nothing is admitted or rejected by "
                     "it; cluster.mode=none enforces it")
    default = RunSettings.telemetry_interval_s
    if float(cfg.run.telemetry_interval_s) != default:
        lines.append(f"run.telemetry_interval_s={cfg.run.telemetry_interval_s} has no effect: "
                     f"cluster.mode={mode} takes no telemetry samples (each rank's timeline "
                     "is in trace.json); cluster.mode=none samples the device")
    asked = [o.split("=", 1)[1].strip().lower() for o in named
             if o.lstrip("+").replace(" ", "").startswith("run.progress=")]
    if asked and asked[-1] in ("true", "yes", "1", "on"):
        lines.append(f"run.progress=true has no effect: cluster.mode={mode} shows no progress "
                     "bars (its ranks train in their own processes; the jobs table follows "
                     "the run); cluster.mode=none shows them")
    return lines


def _validate_settings(cfg: DictConfig) -> list[str]:
    """The checks of every run's settings whatever its plugins (jobs, checkpoints, cluster,
    precision); returns the job ids."""
    specs = job_specs(cfg)
    ids = [job_id_for(i, s) for i, s in enumerate(specs)]
    if int(cfg.run.checkpoint_every) < 0:
        raise UserError(f"run.checkpoint_every must be >= 0 (0 = off), got "
                        f"{cfg.run.checkpoint_every}")
    check_numbers(cfg.cluster)  # bucket_mb: the buckets a job records, in every mode
    refuse_torchrun_without_cluster(cfg)  # a sweep's points too, before the first one runs
    if cfg.cluster.mode != "none":
        from accelopt.drivers.cluster.launch import validate as validate_cluster
        from accelopt.drivers.cluster.settings import settings_from

        validate_cluster(cfg, settings_from(cfg.cluster))
    # finite: nan passes a "<= 0" check, and a sampler or watchdog waiting inf seconds fails
    interval = positive_number(float(cfg.run.telemetry_interval_s), "run.telemetry_interval_s",
                               "seconds between samples", MAX_TIMEOUT_S)
    if interval < MIN_INTERVAL_S:
        raise ConfigError(f"run.telemetry_interval_s must be at least {MIN_INTERVAL_S:g} (CPU "
                          f"time is counted in ~10 ms ticks: shorter intervals read 0% or "
                          f"thousands of percent), got {cfg.run.telemetry_interval_s}; set "
                          f"run.telemetry_interval_s={MIN_INTERVAL_S:g} or more")
    _check_watchdog(cfg.run.hook_watchdog_s)
    if not 0 <= int(cfg.run.threads) <= MAX_THREADS:
        raise UserError(f"run.threads must be in [0, {MAX_THREADS}] (0: the default; this machine "
                        f"has {usable_cores()} cores), got {cfg.run.threads}")
    if str(cfg.run.memory_capacity) != "auto":
        memory_capacity(str(cfg.run.memory_capacity), torch.device("cpu"))  # parses it
    one_process = cfg.cluster.mode == "none"
    device = pick_device(str(cfg.run.device))  # a name no rank could use: refused here
    device_type = device.type if one_process else None
    for spec in specs:  # fp16 needs CUDA and one process: say so before anything starts
        check_precision(spec, device_type, one_process)
    return ids


def _check_watchdog(value: Any) -> None:
    """``run.hook_watchdog_s``: 0 (off) or a finite number of seconds up to
    :data:`MAX_TIMEOUT_S`. A refusal says ">= 0": :func:`positive_number`'s "> 0" would
    contradict the 0 (off) it accepts."""
    what = "seconds a hook call may run before a warning; 0: off"
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"run.hook_watchdog_s must be a finite number >= 0 ({what}), "
                          f"got {value!r}")
    if seconds > 0:
        positive_number(seconds, "run.hook_watchdog_s", what, MAX_TIMEOUT_S)


def _reference_sets(cfg: DictConfig, console: Console) -> list[tuple[str, ...]]:
    """``run.compare``: the reference sets (no plugins; each plugin alone) run before this
    run, in this invocation; none without plugins or in a sweep (the line says which, so a
    comparison asked for never just goes missing). A resumed run's config asks for them
    only where that run stopped before they ended (:func:`references_unfinished`): they
    run again from the beginning, as its own jobs do (it had none to resume), so the
    comparison is measured within one invocation."""
    mode = compare.compare_mode(cfg)
    selected = selected_plugins(cfg)
    if mode == "none" or not selected:
        return []
    if compare.in_multirun():
        console.print(f"[dim]run.compare={mode}: no reference runs here: a sweep (-m) "
                      "compares its own points: add +plugins=[] as one, or use accelopt "
                      "bench[/dim]")
        return []
    return compare.variants(selected, mode)


def _without_compare(cfg: DictConfig) -> DictConfig:
    """``cfg`` asking for no reference runs (a copy; ``cfg`` itself where it asks for none):
    what this run's ``config.yaml`` says once they ended, or where it runs none."""
    if compare.compare_mode(cfg) == "none":
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.run.compare = "none"
    return cfg


def _execute_local(cfg: DictConfig, run_dir: Path, registry: Registry, console: Console,
                   refs: dict[str, RunRecord], resume_from: Path | None,
                   warnings: list[str]) -> RunRecord:
    setup_torch(cfg.run)
    device = pick_device(str(cfg.run.device))
    specs = job_specs(cfg)
    plugins = activate(cfg, registry, [job_id_for(i, s) for i, s in enumerate(specs)])
    jobs = build_jobs(specs, device, plugins, bucket_bytes=local_info(cfg.cluster).bucket_bytes)
    info = RunInfo(run_dir=str(run_dir), device=str(device), plugins=plugins.names,
                   jobs=tuple(j.info for j in jobs), seed=int(cfg.run.seed),
                   cluster=local_info(cfg.cluster))
    lifecycle = Lifecycle(plugins, info)
    lifecycle.job_built(jobs)
    checkpointer = Checkpointer(run_dir, int(cfg.run.checkpoint_every),
                                bool(cfg.run.save_weights), plugin_settings(cfg))
    restored = restore(resume_from, jobs, checkpointer) if resume_from is not None else {}
    for job in jobs:  # a job that had finished before the resume: its weights (and final
        result = restored.get(job.info.job_id)  # checkpoint) belong in this run's directory
        if result is not None and result.status == "done":
            checkpointer.after_finish(job, result)
    progress = JobProgress(console, enabled=bool(cfg.run.progress))
    sampler = TelemetrySampler(interval_s=float(cfg.run.telemetry_interval_s))
    executor = Executor(
        plugins,
        jobs,
        capacity_bytes=memory_capacity(str(cfg.run.memory_capacity), device),
        device=str(device),
        profiler=measure_profile if cfg.run.profile else None,
        on_iteration=lambda job, result: (
            checkpointer.after_iteration(job, result),
            progress.advance(job.info.job_id),
        ),
        on_finish=lambda job, result: (
            checkpointer.after_finish(job, result),
            progress.finish(job.info.job_id, result.status),
        ),
        results=restored,
        # the samples' time origin is the spans': the jobs' profiling comes before it
        on_clock_start=sampler.start,
    )
    checkpointer.clock = executor.now
    hook_calls: HookTrace = []  # spans made after the run: cheap here
    if cfg.run.trace_hooks:
        plugins.set_trace(hook_calls)
    lifecycle.start(jobs)
    record = RunRecord(info=lifecycle.info, warnings=warnings)
    if resume_from is not None:
        record.metrics["resumed_from"] = str(resume_from)
    started = time.perf_counter()
    results: list[JobResult] | None = None  # set once every job has ended
    writing = False  # the outputs are being written: what stops them keeps what they wrote
    try:
        with progress:
            for job in jobs:
                progress.add_job(job.info.job_id, job.info.name, job.info.iterations)
                if job.iteration:
                    progress.advance(job.info.job_id, job.iteration)
            try:
                with watching(plugins.hook_code, float(cfg.run.hook_watchdog_s)):
                    results = executor.run()
            except BaseException as exc:
                record.telemetry = sampler.stop()
                record.duration_s = time.perf_counter() - started
                record.jobs = [result for _info, result, _busy in executor.snapshot()]
                _not_scored(record.jobs, jobs, exc)
                record.spans = _local_spans(executor, hook_calls)
                # a hook's refusal mid-run, or any error once the clock ran: jobs had started
                jobs_started = raised_by_hook(exc) or executor.clock_started is not None
                if jobs_started:
                    record.plugin_rows = _rows_so_far(lifecycle, plugins.names)
                _keep_evidence(record, run_dir, exc, started=jobs_started)
                raise
            record.telemetry = sampler.stop()
        record.duration_s = time.perf_counter() - started
        if cfg.run.profile and executor.clock_started is not None:
            # in duration_s, not in any job's times: say how much of it there was
            record.metrics["profiling_s"] = executor.clock_started - started
        with drawing_process() as renderer:  # imports matplotlib while the jobs are scored
            record.telemetry_note = sampler.note
            record.jobs = results
            for job, result in zip(jobs, results, strict=True):
                score_result(result, job.spec, job.model, job.dataset, job.device)
            record.spans = _local_spans(executor, hook_calls)
            lifecycle.update(jobs)
            record.info = lifecycle.info
            try:
                record.plugin_rows = with_placeholders(lifecycle.merged_rows(), plugins.names)
                lifecycle.end(run_metrics(record))
            except PluginHookError as exc:
                # every job has ended: a plugin raising in its report rows or at run end
                # stops the run, but its results are written first (they used to be lost)
                record.metrics["error"] = error_line(exc)
                record.plugin_rows = record.plugin_rows or (
                    stopped_report(plugins.names, exc.plugin, error_line(exc))
                    if exc.hook == "accelopt_report_rows"
                    else with_placeholders([], plugins.names))
                writing = True
                _write_and_render(record, run_dir, console, refs, renderer)
                raise
            writing = True
            _write_and_render(record, run_dir, console, refs, renderer)
    except BaseException as exc:
        if results is not None and (not writing or not (run_dir / "metrics.json").is_file()):
            # every job had ended: a Ctrl-C or SIGTERM (or an error) before the outputs
            # were written still writes the jobs' results (it used to leave only
            # config.yaml, the log and the weights), also while they were being made,
            # before metrics.json was written (the summary and JSON are computed first)
            record.duration_s = record.duration_s or time.perf_counter() - started
            _keep_finished(record, results, executor, hook_calls, run_dir, exc)
        raise
    return record


def _rows_so_far(lifecycle: Lifecycle, names: Sequence[str]) -> list[ReportRow]:
    """The plugins' rows of a run stopped after its jobs started (Ctrl-C, SIGTERM, an
    error): what each did on the iterations that ran. A stopped run's ``metrics.json``
    listed no plugin, though every one had acted until the stop. Best effort: where the
    rows cannot be made (a plugin failing on its state cut short, a second Ctrl-C), each
    plugin gets the core's placeholder, and the run's own error is the one reported."""
    try:
        return with_placeholders(lifecycle.merged_rows(), names)
    except BaseException:  # noqa: BLE001 - the stop's evidence is written whatever happens
        return with_placeholders([], names)


def _not_scored(results: list[JobResult], jobs: list[Job], exc: BaseException) -> None:
    """Why each job that had finished in a run stopped mid-way has no score (the run scores
    its jobs once every job has ended): it had neither quality nor a note, where a job left
    unscored says why (docs/your-model.md), as a run stopped later does
    (:func:`_keep_finished`). Not scored here: the run was asked to stop, and a held-out
    pass can take long; a resume scores it. A job that would not be scored anyway (an
    inference job, ``evaluate: false``) gets that reason, and one that had not finished
    says so, as in a run that ended."""
    specs = {job.info.job_id: job.spec for job in jobs}
    for result in results:
        if result.quality is not None or result.quality_note:
            continue
        if result.status != "done":
            ended = result.status in ("failed", "rejected")
            result.quality_note = ("the job did not finish "
                                   f"({result.status if ended else 'the run stopped'})")
            continue
        spec = specs.get(result.job.job_id)
        if spec is not None and (not getattr(spec, "evaluate", True) or spec.kind != "train"):
            score_result(result, spec, None, None)  # its reason, without a model
        else:
            result.quality_note = (f"not scored: {error_line(exc)} before the run scored its "
                                   "jobs (it does once every job has ended; a resume does)")


def _keep_finished(record: RunRecord, results: list[JobResult], executor: Executor,
                   hook_calls: HookTrace, run_dir: Path, exc: BaseException) -> None:
    """Keep the evidence of a run stopped after every job had ended, before its outputs
    were written: the jobs' results (each not yet scored says so), the timeline, and the
    error in ``summary.error``."""
    record.jobs = results
    record.spans = record.spans or _local_spans(executor, hook_calls)
    for result in results:  # scored already, or a note saying why not: kept as it is
        if result.quality is None and not result.quality_note:
            result.quality_note = f"not scored: {error_line(exc)} before it was scored"
    _keep_evidence(record, run_dir, exc, started=True)


def _execute_cluster(cfg: DictConfig, run_dir: Path, registry: Registry, console: Console,
                     refs: dict[str, RunRecord], resume_from: Path | None,
                     warnings: list[str]) -> RunRecord:
    from accelopt.drivers.cluster import run_cluster
    from accelopt.drivers.cluster.outcome import service_so_far, stopped_outcome
    from accelopt.drivers.cluster.settings import settings_from

    names = tuple(s.name for s in resolve(selected_plugins(cfg), registry))
    settings = settings_from(cfg.cluster)
    info = RunInfo(str(run_dir), "cluster", names, (), int(cfg.run.seed),
                   world_size=settings.world_size, cluster=settings.info(settings.backend))
    record = RunRecord(info=info, warnings=warnings)
    if resume_from is not None:
        record.metrics["resumed_from"] = str(resume_from)
    started = time.perf_counter()
    # The outputs' drawing process starts as soon as the leader has run the last iteration,
    # so it imports matplotlib while the ranks hand over their results and the jobs are
    # scored (renderer.py).
    drawing = drawing_process()
    try:
        outcome = run_cluster(cfg, run_dir=run_dir, console=console, registry=registry,
                              while_ranks_start=_before_ranks(settings.mode),
                              when_jobs_end=drawing.start)
    except BaseException as exc:
        drawing.close()
        if getattr(exc, "never_started", False):
            raise  # refused as the ranks built their jobs: nothing to keep (launch.py)
        record.duration_s = time.perf_counter() - started
        specs = job_specs(cfg)
        ended = getattr(exc, "ended", {})
        reached = getattr(exc, "reached", getattr(exc, "iteration", None))
        left = getattr(exc, "so_far", [])
        record.jobs = [_ended_before(JobResult(job_info(s, job_id_for(i, s))), ended, reached,
                                    _completed(left, job_id_for(i, s), settings),
                                    service_so_far(left, job_id_for(i, s), settings))
                       for i, s in enumerate(specs)]
        stopped = stopped_outcome(left, record.jobs, settings)
        record.spans, per_iteration = stopped.spans, stopped.per_iteration
        record.metrics.update(stopped.metrics)
        record.telemetry_note = _stopped_note([r.rank for r in left], settings.world_size,
                                              torchrun=under_torchrun())
        if not under_torchrun() or os.environ.get("RANK") == "0":
            # under torchrun only rank 0 writes, as on success: ranks sharing one
            # hydra.run.dir (for checkpoints) wrote over rank 0's metrics.json with their own
            # view of the failure, the last one's winning
            _stopped_cluster_notes(record, specs, exc)
            _keep_evidence(record, run_dir, exc)
            if per_iteration:
                with contextlib.suppress(OSError):  # evidence: the run's error matters more
                    _write_per_iteration(per_iteration, run_dir)
        raise
    record.duration_s = time.perf_counter() - started
    if not outcome.primary:  # under torchrun, only rank 0 writes the run's outputs
        drawing.close()
        return record
    # The collector is paused: the records of every rank are live objects only.
    with drawing as renderer, collector_paused():
        record.jobs = list(outcome.results)
        record.spans = list(outcome.spans)
        record.metrics.update(outcome.metrics)
        backend = str(outcome.metrics.get("cluster_backend", settings.backend))
        record.info = dataclasses.replace(info, jobs=tuple(r.job for r in record.jobs),
                                          cluster=settings.info(backend))
        record.telemetry_note = "cluster run: per-rank timelines are in trace.json"
        record.warnings = [*record.warnings, *outcome.warnings]
        for line in outcome.warnings:
            console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
        record.plugin_rows = with_placeholders(list(outcome.plugin_rows), names)
        # a file the machine refuses (a full disk, a directory made read-only) stops the
        # run after the rest is written and the summary printed: its results exist
        refused: OutputUnwritable | None = None
        try:
            _write_per_iteration(outcome.per_iteration, run_dir)
            if cfg.run.save_weights:
                _save_cluster_weights(record.jobs, outcome.state, run_dir)
        except OutputUnwritable as exc:
            refused = exc
        _score_cluster_jobs(cfg, registry, record.jobs, outcome.state)
        _write_and_render(record, run_dir, console, refs, renderer)
        if refused is not None:
            raise refused
    return record


def _stopped_cluster_notes(record: RunRecord, specs: list[Any], exc: BaseException) -> None:
    """Why each job of a cluster run stopped by ``exc`` has no score, as one process says
    it (:func:`_not_scored`): its quality_note was empty. A job the run stopped: "did not
    finish (the run stopped)"; the job whose own code failed on a rank, or one that had
    failed: "did not finish (failed)"; a finished job keeps the note it was given."""
    culprit = exc.job_id if isinstance(exc, RankFailed) else ""
    for result in record.jobs:
        if (result.quality is None and not result.quality_note and result.job.job_id != culprit
                and result.status not in ("done", "failed", "rejected")):
            result.quality_note = "the job did not finish (the run stopped)"
    _mark_stopped(record, exc)
    for spec, result in zip(specs, record.jobs, strict=True):
        if result.quality is None and not result.quality_note:
            score_result(result, spec, None, None)  # its reason, without a model


def _stopped_note(ranks: list[int], world: int, *, torchrun: bool = False) -> str:
    """A stopped cluster run's telemetry note: whose timelines its trace holds (a rank
    killed outright leaves none). ``torchrun``: the ranks are torchrun's processes, not
    this launcher's, so what they ran so far is not collected: the note says that the
    iterations counted have no losses or timeline kept, lest the outputs read as whole."""
    if torchrun and not ranks:
        return ("the cluster run stopped under torchrun: the losses and timelines of the "
                "iterations its ranks ran are not kept (metrics.json counts those iterations; "
                "its losses and trace.json do not hold them)")
    if not ranks:
        return ("the cluster run failed: the ranks' timelines ended with their processes and "
                "are not in trace.json")

    def named(which: list[int]) -> str:
        return f"rank{'s' if len(which) > 1 else ''} {', '.join(map(str, which))}"

    missing = [r for r in range(world) if r not in ranks]
    held = f"the timelines of {named(ranks)}" if missing else "every rank's timeline"
    lost = f"; {named(missing)} left none (killed, or stuck)" if missing else ""
    return f"the cluster run failed: trace.json holds {held} up to the stop{lost}"


def _before_ranks(mode: str) -> Callable[[], None] | None:
    """What the launcher does while its ranks start: where their forkserver preloads dynamo
    (all-reduce), it is ready well after the launcher reaches its fork point, so matplotlib
    is imported then, at no cost, and the chart is drawn here after the run (no drawing
    process: :func:`accelopt.report.renderer.drawing_process`)."""
    return import_matplotlib if preloads_dynamo({mode}) else None


def _score_cluster_jobs(cfg: DictConfig, registry: Registry, results: list[JobResult],
                        state: dict[str, Any]) -> None:
    """Score each finished job's gathered weights here, in the launcher: the model is built
    as the ranks built it (same plugins, so layers a plugin replaced at build time have the
    same shapes) without an optimizer, then loaded; with the ranks' thread count, which also
    leaves the other core to the outputs' drawing process meanwhile (torch's threads on a
    core that is busy wait for it: scoring on both cores took twice as long)."""
    with torch_threads(rank_threads(cfg.run)):
        _score_jobs_here(cfg, registry, results, state)


def _score_jobs_here(cfg: DictConfig, registry: Registry, results: list[JobResult],
                     state: dict[str, Any]) -> None:
    specs = job_specs(cfg)
    ids = [job_id_for(i, s) for i, s in enumerate(specs)]
    wanted = [r for r in results if r.status == "done" and r.job.kind == "train"]
    plugins = activate(cfg, registry, ids) if wanted else None
    for spec, job_id, result in zip(specs, ids, results, strict=True):
        model = dataset = None
        weights = state if len(results) == 1 else state.get(job_id, {})
        if result in wanted and weights and spec.evaluate and plugins is not None:
            try:
                scorer = Job(spec, job_id=job_id, device=torch.device("cpu"),
                             host=plugins.for_job(job_id), exchange=BUILD_ONLY)
                scorer.model.load_state_dict(weights)
                model, dataset = scorer.model, scorer.dataset
            except Exception as exc:  # noqa: BLE001 - say why, never fail the finished run
                result.quality_note = f"cannot rebuild the model to score it: {exc}"[:300]
                continue
        score_result(result, spec, model, dataset)


SET_UP_TRACK = "set-up (before the clock)"
"""The track of the hook calls made before the run's clock started (``accelopt_run_start``,
the jobs' profiling): at time 0, each with how long before it it began."""


def _local_spans(executor: Executor, hook_calls: HookTrace) -> list[Span]:
    """The executor's iterations and every hook call, on the run's clock. A call made before
    the clock started (the run's start, the jobs' memory profiling) is on
    :data:`SET_UP_TRACK` at time 0, its real start in its ``before_clock_s``: at its own
    time it was negative, trace.json began seconds before the run and the timeline's axis
    left the run a sliver of the chart."""
    spans = executor.spans
    for span in hook_spans(hook_calls, -executor._t0):
        if span.start_s < 0:
            span = dataclasses.replace(
                span, track=SET_UP_TRACK, start_s=0.0, end_s=max(span.end_s, 0.0),
                args={**span.args, "before_clock_s": round(-span.start_s, 6),
                      "duration_s": round(span.end_s - span.start_s, 6)})
        spans.append(span)
    return spans


def _completed(left: list[Any], job_id: str, settings: Any) -> int | None:
    """How many iterations of ``job_id`` every worker of a stopped cluster run had finished
    (those carried from a checkpoint included): each worker's records end with its last
    finished iteration, and the job's losses and trace are of these. ``None`` unless every
    worker left its records (one killed outright)."""
    from accelopt.drivers.cluster.outcome import workers_records

    records = workers_records(left, job_id, settings)
    return min(map(len, records)) if records else None


def _ended_before(result: JobResult, ended: dict[str, dict[str, Any]],
                  reached: int | None = None, completed: int | None = None,
                  service: float | None = None) -> JobResult:
    """A cluster job as the run left it when it stopped (the leader's record): a job that
    had ended, as it ended (status, iterations, samples, service time, JCT and queueing
    delay, from its arrival after every rank had built every job, as a successful run
    counts them); its weights were never gathered (the ranks hand them over at the end), so
    it has no score. A job that had not ended keeps the iterations it had run (and their
    samples) when the leader last left it, or, the job it was running, ``reached`` (the
    iteration the failing rank was in, from its progress file) where that is known; but
    ``completed`` (:func:`_completed`), where the workers left their records: the
    iterations every worker finished, which its losses and trace count (the leader's
    progress ran ahead of them: a parameter server was 5 iterations past the workers).

    A job that had started, ended or not, keeps its queueing delay (its first start) and
    service time (so samples/s), as in one process: a running job's service time is
    ``service`` (:func:`~accelopt.drivers.cluster.outcome.service_so_far`: the iterations
    every worker finished, which its samples count) plus what a checkpoint carried, where
    the workers left their records, else what the leader recorded when it last left it.

    Its times are on the training clock, as a finished run's (``build_outcome``): its
    arrival as configured (0 when every rank had built every job), its first start and end
    that arrival plus the queueing delay and JCT the leader recorded."""
    arrival = result.job.arrival_s
    mine = ended.get(result.job.job_id)
    if mine is None:
        return result
    result.iterations_done = int(mine.get("iterations") or 0)
    if mine.get("queueing_s") is not None:
        result.admitted_s = arrival
        result.first_start_s = arrival + float(mine["queueing_s"])
    if mine.get("status") == "running":
        if completed is not None:
            result.iterations_done = min(completed, result.job.iterations)
        elif mine.get("current") and reached is not None:
            result.iterations_done = min(max(result.iterations_done, reached),
                                         result.job.iterations)
        result.samples = result.iterations_done * result.job.batch_size
        result.service_s = (float(mine.get("carried_service_s") or 0.0) + service
                            if service is not None else float(mine.get("service_s") or 0.0))
        return result
    result.status = mine["status"]
    result.error = mine.get("error") or ""
    result.samples = int(mine.get("samples") or 0)
    result.service_s = float(mine.get("service_s") or 0.0)
    result.admitted_s = arrival
    if mine.get("jct_s") is not None:
        result.end_s = arrival + float(mine["jct_s"])
    if result.status == "done":
        result.quality_note = ("not scored: the run stopped before the ranks handed over "
                               "the weights")
    return result


def _keep_evidence(record: RunRecord, run_dir: Path, exc: BaseException,
                   started: bool = False) -> None:
    """A run that stops on an error still leaves its evidence: metrics.json with every job's
    status (a job that had not ended is ``failed`` with the run's error), the error line in
    ``summary.error``, and the trace and timeline so far. Best effort: a failure while
    writing must not hide the run's own error. A refusal of bad input before any job
    started writes nothing; ``started``: jobs had run (a plugin's hook refusing mid-run, a
    rank's failure), so its evidence is kept whatever the error's class."""
    if isinstance(exc, UserError) and not isinstance(exc, RankFailed) and not started:
        return  # a refusal (bad input found before the work began): nothing to keep
    _mark_stopped(record, exc)
    record.metrics["error"] = error_line(exc)
    try:
        write_run_outputs(record, run_dir)
    except Exception:  # noqa: BLE001 - the run's error is the one to report
        pass


def _mark_stopped(record: RunRecord, exc: BaseException) -> None:
    """Every job of a run stopped by ``exc`` that had not ended is ``failed``, with the
    run's error (the job whose own code failed on a rank, with that error). Apart from
    :func:`_keep_evidence`, so a stopped cluster run can say why each failed job has no
    score before its evidence is written, as one process does."""
    error = error_line(exc)
    culprit, own = "", ""  # a rank failed inside a job's iteration, by that job's own code
    if isinstance(exc, RankFailed) and exc.job_id:
        culprit, own = exc.job_id, f"{exc.cause} (rank {exc.rank}, iteration {exc.iteration})"
    for result in record.jobs:
        if result.status not in ("done", "failed", "rejected"):
            result.status = "failed"
            if result.job.job_id == culprit:  # its own error, as in one process
                result.error = result.error or own
            result.error = result.error or f"the run stopped: {error}"


def error_line(exc: BaseException) -> str:
    """The error as the command line prints it (accelopt's own errors are one line
    already; anything else gets its type)."""
    if isinstance(exc, Terminated):
        return "terminated (SIGTERM)"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    return first_line(exc) if isinstance(exc, AccelOptError) else error_text(exc)


def _write_and_render(record: RunRecord, run_dir: Path, console: Console,
                      refs: dict[str, RunRecord] | None,
                      renderer: TimelineRenderer | None = None) -> None:
    if refs:
        compare.attach(record, refs)
    record.summary = run_metrics(record)
    refused: OutputUnwritable | None = None
    try:
        write_run_outputs(record, run_dir, renderer)
    except OutputUnwritable as exc:  # the results exist: shown before the one line saying so
        refused = exc
    render_summary(record, console)
    if refs:
        console.print(compare.table(record, refs))
    # escaped: a directory named with brackets (``out-[clip]``, a sweep's override_dirname)
    # lost them to rich's markup
    console.print(f"[dim]run directory: {escape(str(shown_path(run_dir)))}[/dim]")
    if refused is not None:
        raise refused


def _save_config(cfg: DictConfig, run_dir: Path) -> None:
    with atomic_open(run_dir / CONFIG_FILE) as handle:
        handle.write(OmegaConf.to_yaml(cfg, resolve=True))


def _maybe_resume(
    cfg: DictConfig, run_dir: Path, console: Console, overrides: Sequence[str] | None = None
) -> tuple[DictConfig, Path | None]:
    """``run.resume=<dir>``: continue that run from its checkpoints, with its own config
    (but for the :data:`HONOURED` settings ``overrides`` gives), into this invocation's own
    ``run_dir``; the old directory is only read. Returns the config to run and the
    directory resumed from (``None``: not resuming)."""
    if cfg.run.resume is None:
        return cfg, None
    if not str(cfg.run.resume).strip():  # `run.resume=` started a new run, recorded as ''
        raise UserError("run.resume is empty: give the run directory to resume, or leave "
                        "run.resume out")
    old_dir = resume_target(str(cfg.run.resume))
    if old_dir.resolve() == Path(run_dir).resolve():
        raise UserError(f"run.resume: {old_dir} is also this run's output directory; a resumed "
                        "run writes into a new directory (drop hydra.run.dir)")
    resume_finished = bool(cfg.run.get("resume_finished", False))
    resumed = run_config(old_dir)
    resumed.run.resume = str(old_dir)
    resumed.run.resume_finished = resume_finished
    for key in honoured(_command_line() if overrides is None else overrides):
        OmegaConf.update(resumed, key, OmegaConf.select(cfg, key), merge=False)
    refuse_finished(old_dir, resume_finished)
    _refuse_other_checkpoints(old_dir, resumed)
    mode = references_unfinished(old_dir)
    if mode:
        console.print(f"resuming {old_dir}: it stopped during its run.compare={mode} reference "
                      "runs, before its own jobs began, so the reference runs start again from "
                      "the beginning, then its jobs (a comparison is measured within one "
                      f"invocation); writing into {run_dir}")
    elif has_checkpoints(old_dir):
        console.print(f"resuming {old_dir} from its checkpoints (carried into the new "
                      f"directory, which can be resumed in turn); writing into {run_dir}")
    else:
        console.print(f"resuming {old_dir}: it wrote no checkpoint (run.checkpoint_every was 0, "
                      f"or it stopped before the first), so its jobs start from the beginning; "
                      f"writing into {run_dir}")
    note = packed_sweep_note(old_dir, Path(run_dir))
    if note:
        console.print(note, markup=False, highlight=False, soft_wrap=True)
    return resumed, old_dir  # type: ignore[return-value]


def _refuse_other_checkpoints(old_dir: Path, cfg: DictConfig) -> None:
    """The checkpoints resumed from must be of this run's jobs (and in a cluster, of as many
    ranks), checked before anything is written: the jobs' restore found out after the new
    directory held the carried checkpoints, the config, the log (and in a cluster the
    outputs of a run that never trained), though the refusal said nothing was written. Every
    file it would carry must be readable too (a damaged one was linked in before its
    refusal). Each must have been written with the plugins and plugin settings of the
    config resumed (an edited ``config.yaml``: refused, where it either ran half the job with
    other settings or was refused by a plugin's state load after the directory was made)."""
    from accelopt.drivers.cluster.checkpoints import refuse_unresumable, unreadable_hint
    from accelopt.drivers.cluster.settings import settings_from
    from accelopt.job.checkpoint import (
        UNREADABLE_HINT,
        read_checkpoint,
        refuse_other_plugins,
        refuse_other_spec,
    )

    if not has_checkpoints(old_dir):
        return
    settings = plugin_settings(cfg)
    # every file carried, before any is (a damaged one is refused, not linked), read once
    for path in sorted((old_dir / CHECKPOINT_DIR).rglob("*.pt")):
        hint = UNREADABLE_HINT if cfg.cluster.mode == "none" else unreadable_hint(path)
        state = read_checkpoint(path, hint)
        refuse_other_plugins(path, state, settings, old_dir / CONFIG_FILE)
    try:
        specs = job_specs(cfg)
    except ConfigError:
        return  # a workload that builds no jobs: the run's own validation says so
    for k, spec in enumerate(specs):
        job_id = job_id_for(k, spec)
        if cfg.cluster.mode == "none":
            path = old_dir / CHECKPOINT_DIR / f"{job_id}.pt"
            if path.is_file():
                refuse_other_spec(path, spec)
        else:
            refuse_unresumable(old_dir, job_id, spec, settings_from(cfg.cluster).world_size)


def _command_line() -> list[str]:
    """The overrides Hydra composed this run from (none outside ``accelopt run``)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _save_cluster_weights(jobs: list[JobResult], state: dict[str, Any], run_dir: Path) -> None:
    """``weights/<job_id>.pt`` of every job that finished, as a one-process run writes them:
    the trained parameters (gathered from the servers in PS mode) and the buffers."""
    from accelopt.job.checkpoint import WEIGHTS_DIR, atomic_torch_save

    for result in jobs:
        if result.status != "done":
            continue
        weights = state if len(jobs) == 1 else state.get(result.job.job_id, {})
        if weights:
            atomic_torch_save(weights, run_dir / WEIGHTS_DIR / f"{result.job.job_id}.pt")


def _write_per_iteration(rows: list[dict[str, Any]], run_dir: Path) -> None:
    """A cluster run's per-(job, worker, iteration) Mc/Pc/U/E/a (one job or several)."""
    import json

    with atomic_open(run_dir / "per_iteration.json") as handle:
        handle.write(json.dumps(rows, indent=1, default=str) + "\n")


__all__ = ["execute", "validate", "JobResult"]
