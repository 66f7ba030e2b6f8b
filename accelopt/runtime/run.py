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

import copy
import dataclasses
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from accelopt.activation import activate, selected_plugins
from accelopt.atomic import atomic_open
from accelopt.drivers.cluster.settings import local_info
from accelopt.drivers.lifecycle import Lifecycle
from accelopt.drivers.local import Executor
from accelopt.drivers.rows import with_placeholders
from accelopt.drivers.setup import memory_capacity, pick_device, setup_torch
from accelopt.errors import UserError
from accelopt.job import build_jobs, job_id_for, job_specs
from accelopt.job.checkpoint import Checkpointer, restore
from accelopt.job.profile import measure_profile
from accelopt.plugin import Registry, resolve
from accelopt.records import JobResult, RunRecord, Span
from accelopt.report import JobProgress, render_summary, run_metrics, write_run_outputs
from accelopt.report.console import default_console
from accelopt.runtime import compare
from accelopt.telemetry import TelemetrySampler
from accelopt.types import RunInfo

CONFIG_FILE = "config.yaml"


def execute(
    cfg: DictConfig,
    *,
    run_dir: Path,
    registry: Registry | None = None,
    console: Console | None = None,
) -> RunRecord:
    """Run the configured workload; return what it measured (outputs already written)."""
    console = console or default_console()
    registry = registry or Registry.discover()
    cfg, run_dir, resuming = _maybe_resume(cfg, run_dir, console)
    reference_sets = _reference_sets(cfg, resuming)
    validate(cfg, registry, reference_sets)
    refs = compare.run_references(cfg, reference_sets, run_dir, registry, console)
    if refs:
        cfg = copy.deepcopy(cfg)
        cfg.run.compare = "none"
    run_dir.mkdir(parents=True, exist_ok=True)
    _save_config(cfg, run_dir)
    if cfg.cluster.mode != "none":
        return _execute_cluster(cfg, run_dir, registry, console, refs)
    return _execute_local(cfg, run_dir, registry, console, refs, resuming)


def validate(cfg: DictConfig, registry: Registry,
             reference_sets: list[tuple[str, ...]] = ()) -> None:
    """Everything that can be checked before a job runs: the jobs, the cluster settings, and
    each plugin set (this run's and every reference set's) activated and configured once."""
    specs = job_specs(cfg)
    ids = [job_id_for(i, s) for i, s in enumerate(specs)]
    if cfg.cluster.mode != "none":
        from accelopt.drivers.cluster.launch import validate as validate_cluster
        from accelopt.drivers.cluster.settings import settings_from

        validate_cluster(cfg, settings_from(cfg.cluster))
    for subset in [None, *reference_sets]:
        activate(cfg if subset is None else compare.subset_config(cfg, subset), registry, ids)


def _reference_sets(cfg: DictConfig, resuming: bool) -> list[tuple[str, ...]]:
    """``run.compare``: the reference sets (no plugins; each plugin alone) run before this
    run, in this invocation; none without plugins, when resuming, or in a sweep."""
    mode = compare.compare_mode(cfg)
    selected = selected_plugins(cfg)
    if mode == "none" or not selected or resuming or compare.in_multirun():
        return []
    return compare.variants(selected, mode)


def _execute_local(cfg: DictConfig, run_dir: Path, registry: Registry, console: Console,
                   refs: dict[str, RunRecord], resuming: bool) -> RunRecord:
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
    checkpointer = Checkpointer(run_dir, int(cfg.run.checkpoint_every), bool(cfg.run.save_weights))
    restored = restore(run_dir, jobs) if resuming else {}
    progress = JobProgress(console, enabled=bool(cfg.run.progress))
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
    )
    hook_calls: list[tuple[str, float, float]] = []  # spans made after the run: cheap here
    if cfg.run.trace_hooks:
        plugins.set_trace(hook_calls)
    sampler = TelemetrySampler(interval_s=float(cfg.run.telemetry_interval_s))
    lifecycle.start()
    record = RunRecord(info=lifecycle.info)
    started = time.perf_counter()
    with progress:
        for job in jobs:
            progress.add_job(job.info.job_id, job.info.name, job.info.iterations)
            if job.iteration:
                progress.advance(job.info.job_id, job.iteration)
        sampler.start(started)
        try:
            results = executor.run()
        finally:
            record.telemetry = sampler.stop()
    record.duration_s = time.perf_counter() - started
    record.telemetry_note = sampler.note
    record.jobs = results
    t0 = executor._t0
    record.spans = executor.spans + [Span(h, "hooks", s - t0, e - t0, category="hook")
                                     for h, s, e in hook_calls]
    lifecycle.update(jobs)
    record.info = lifecycle.info
    record.plugin_rows = with_placeholders(lifecycle.merged_rows(), plugins.names)
    lifecycle.end(run_metrics(record))
    _write_and_render(record, run_dir, console, refs)
    return record


def _execute_cluster(cfg: DictConfig, run_dir: Path, registry: Registry, console: Console,
                     refs: dict[str, RunRecord]) -> RunRecord:
    from accelopt.drivers.cluster import run_cluster
    from accelopt.drivers.cluster.settings import settings_from

    names = tuple(s.name for s in resolve(selected_plugins(cfg), registry))
    settings = settings_from(cfg.cluster)
    info = RunInfo(str(run_dir), "cluster", names, (), int(cfg.run.seed),
                   world_size=settings.world_size, cluster=settings.info(settings.backend))
    record = RunRecord(info=info)
    started = time.perf_counter()
    outcome = run_cluster(cfg, run_dir=run_dir, console=console, registry=registry)
    record.duration_s = time.perf_counter() - started
    if not outcome.primary:  # under torchrun, only rank 0 writes the run's outputs
        return record
    record.jobs = list(outcome.results)
    record.spans = list(outcome.spans)
    record.metrics.update(outcome.metrics)
    backend = str(outcome.metrics.get("cluster_backend", settings.backend))
    record.info = dataclasses.replace(info, jobs=tuple(r.job for r in record.jobs),
                                      cluster=settings.info(backend))
    record.telemetry_note = "cluster run: per-rank timelines are in trace.json"
    record.plugin_rows = with_placeholders(list(outcome.plugin_rows), names)
    if len(record.jobs) > 1:
        _write_per_iteration(outcome.per_iteration, run_dir)
    _write_and_render(record, run_dir, console, refs)
    return record


def _write_and_render(record: RunRecord, run_dir: Path, console: Console,
                      refs: dict[str, RunRecord] | None) -> None:
    if refs:
        compare.attach(record, refs)
    write_run_outputs(record, run_dir)
    render_summary(record, console)
    if refs:
        console.print(compare.table(record, refs))
    console.print(f"[dim]run directory: {run_dir}[/dim]")


def _save_config(cfg: DictConfig, run_dir: Path) -> None:
    with atomic_open(run_dir / CONFIG_FILE) as handle:
        handle.write(OmegaConf.to_yaml(cfg, resolve=True))


def _maybe_resume(
    cfg: DictConfig, run_dir: Path, console: Console
) -> tuple[DictConfig, Path, bool]:
    """``run.resume=<dir>``: continue that run, in that directory, with its own config."""
    if not cfg.run.resume:
        return cfg, run_dir, False
    old_dir = Path(str(cfg.run.resume)).expanduser()
    saved = old_dir / CONFIG_FILE
    if not saved.is_file():
        raise UserError(f"run.resume: {old_dir} has no {CONFIG_FILE}; pass the directory of a "
                        "run that accelopt wrote")
    from accelopt.config import AccelConfig

    resumed = OmegaConf.merge(OmegaConf.structured(AccelConfig), OmegaConf.load(saved))
    resumed.run.resume = str(old_dir)
    console.print(f"resuming {old_dir} from its checkpoints")
    return resumed, old_dir, True  # type: ignore[return-value]


def _write_per_iteration(rows: list[dict[str, Any]], run_dir: Path) -> None:
    """A multi-job cluster run's per-(job, worker, iteration) Mc/Pc/U/E/a."""
    import json

    with atomic_open(run_dir / "per_iteration.json") as handle:
        handle.write(json.dumps(rows, indent=1, default=str) + "\n")


__all__ = ["execute", "validate", "JobResult"]
