"""A run: build the workload from config, drive it under the active plugins, write outputs.

This is the only place that wires the pieces together (plugins, jobs, executor, telemetry,
checkpoints, report); each piece stays ignorant of the others.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from accelopt.atomic import atomic_open
from accelopt.config import JobConfig
from accelopt.errors import ConfigError, UserError
from accelopt.host import PluginHost
from accelopt.plugin import Registry
from accelopt.records import JobResult, RunRecord, Span
from accelopt.report import JobProgress, render_summary, run_metrics, write_run_outputs
from accelopt.report.console import default_console
from accelopt.runtime.activation import activate
from accelopt.runtime.checkpoint import Checkpointer, restore
from accelopt.runtime.executor import Executor
from accelopt.runtime.job import Job, layer_build_hook
from accelopt.runtime.profile import measure_profile
from accelopt.telemetry import TelemetrySampler
from accelopt.types import ReportRow, RunInfo
from accelopt.units import parse_bytes
from accelopt.workloads import generate_trace

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
    refs = _compare_first(cfg, run_dir, registry, console, resuming)
    if refs:
        cfg = copy.deepcopy(cfg)
        cfg.run.compare = "none"
    run_dir.mkdir(parents=True, exist_ok=True)
    _save_config(cfg, run_dir)
    _setup_torch(cfg)
    device = pick_device(str(cfg.run.device))
    host = activate(cfg, registry)
    specs = job_specs(cfg)
    if cfg.cluster.mode != "none":
        return _execute_cluster(cfg, run_dir, host, console, refs)

    jobs = build_jobs(specs, device, host)
    info = RunInfo(
        run_dir=str(run_dir),
        device=str(device),
        plugins=host.names,
        jobs=tuple(j.info for j in jobs),
        seed=int(cfg.run.seed),
    )
    record = RunRecord(info=info)
    checkpointer = Checkpointer(run_dir, int(cfg.run.checkpoint_every), bool(cfg.run.save_weights))
    restored = restore(run_dir, jobs) if resuming else {}
    progress = JobProgress(console, enabled=bool(cfg.run.progress))
    executor = Executor(
        host,
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
    hook_spans: list[Span] = []
    if cfg.run.trace_hooks:
        host.timer = lambda hook, start, end: hook_spans.append(
            Span(hook, "hooks", start - executor._t0, end - executor._t0, category="hook")
        )
    sampler = TelemetrySampler(interval_s=float(cfg.run.telemetry_interval_s))
    host.call("accelopt_run_start", run=info)
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
    record.spans = executor.spans + hook_spans
    return _finish(record, host, run_dir, console, refs)


def _finish(record: RunRecord, host: PluginHost, run_dir: Path, console: Console,
            refs: dict[str, RunRecord] | None = None) -> RunRecord:
    host.call("accelopt_run_end", run=record.info, metrics=run_metrics(record))
    record.plugin_rows = plugin_rows(host, record.info)
    _write_and_render(record, run_dir, console, refs)
    return record


def _write_and_render(record: RunRecord, run_dir: Path, console: Console,
                      refs: dict[str, RunRecord] | None) -> None:
    if refs:
        from accelopt.runtime import compare

        compare.attach(record, refs)
    write_run_outputs(record, run_dir)
    render_summary(record, console)
    if refs:
        console.print(compare.table(record, refs))
    console.print(f"[dim]run directory: {run_dir}[/dim]")


def _compare_first(cfg: DictConfig, run_dir: Path, registry: Registry, console: Console,
                   resuming: bool) -> dict[str, RunRecord]:
    """``run.compare``: run the reference sets (no plugins; each plugin alone) before this
    run, in this invocation; nothing to do without plugins, when resuming, or in a sweep."""
    from accelopt.runtime import compare
    from accelopt.runtime.activation import selected_plugins

    mode = compare.compare_mode(cfg)
    selected = selected_plugins(cfg)
    if mode == "none" or not selected or resuming or compare.in_multirun():
        return {}
    return compare.run_references(cfg, selected, mode, run_dir, registry, console)


def plugin_rows(host: PluginHost, info: RunInfo) -> list[ReportRow]:
    """Every active plugin gets a line: its own, or one saying it reported nothing."""
    rows = [row for answer in host.call("accelopt_report_rows", run=info) for row in answer or []]
    reported = {row.plugin for row in rows}
    rows += [
        ReportRow(plugin=name, summary="active, but reported nothing about what it did")
        for name in host.names
        if name not in reported
    ]
    return rows


def job_specs(cfg: DictConfig) -> list[JobConfig]:
    """The workload's explicit jobs followed by its generated trace (if any)."""
    specs: list[JobConfig] = [OmegaConf.to_object(j) for j in cfg.workload.jobs]  # type: ignore[misc]
    gen = cfg.workload.generate
    if gen.n_jobs:
        try:
            trace = generate_trace(
                n_jobs=int(gen.n_jobs),
                seed=int(gen.seed),
                mean_interarrival_s=float(gen.mean_interarrival_s),
                models=list(gen.models),
                batch_sizes=list(gen.batch_sizes),
                min_iterations=int(gen.min_iterations),
                max_iterations=int(gen.max_iterations),
                pareto_alpha=float(gen.pareto_alpha),
            )
        except ValueError as exc:
            raise ConfigError(f"workload.generate: {exc}") from None
        specs += [
            JobConfig(
                name=t.name,
                model=t.model,
                dataset=t.dataset,
                batch_size=t.batch_size,
                iterations=t.iterations,
                arrival_s=t.arrival_s,
                seed=t.seed,
                optimizer="adam" if t.model in ("lstm", "transformer") else "sgd",
                lr=1e-3 if t.model in ("lstm", "transformer") else 0.05,
            )
            for t in trace
        ]
    if not specs:
        raise ConfigError("the workload has no jobs; add workload.jobs or workload.generate.n_jobs")
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"workload job names must be unique; repeated: {', '.join(duplicates)}")
    return specs


def build_jobs(specs: list[JobConfig], device: torch.device, host: PluginHost) -> list[Job]:
    """Build every job's model once, offering each layer to the layer-forward hook."""
    layer_hook = layer_build_hook(host)
    return [
        Job(spec, job_id=f"{i:02d}-{spec.name}", device=device, layer_hook=layer_hook)
        for i, spec in enumerate(specs)
    ]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device: unknown device {name!r}; use auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device=cuda but no CUDA device is available; use run.device=cpu")
    return device


def memory_capacity(text: str, device: torch.device) -> int:
    """The capacity allocation hooks are told about: the real device memory on CUDA, the
    machine's RAM on CPU (where it is accounting only), or what the user configured."""
    if text != "auto":
        capacity = parse_bytes(text, "run.memory_capacity")
        if capacity <= 0:
            raise ConfigError("run.memory_capacity must be positive, e.g. 2GiB")
        return capacity
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(psutil.virtual_memory().total)


def _setup_torch(cfg: DictConfig) -> None:
    torch.manual_seed(int(cfg.run.seed))
    if cfg.run.threads:
        torch.set_num_threads(int(cfg.run.threads))
    if cfg.run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


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


def _execute_cluster(
    cfg: DictConfig, run_dir: Path, host: PluginHost, console: Console,
    refs: dict[str, RunRecord] | None = None,
) -> RunRecord:
    from accelopt.cluster import run_cluster

    info = RunInfo(str(run_dir), "cluster", host.names, (), int(cfg.run.seed))
    record = RunRecord(info=info)
    started = time.perf_counter()
    outcome = run_cluster(cfg, run_dir=run_dir, console=console)
    record.duration_s = time.perf_counter() - started
    if not outcome.primary:  # under torchrun, only rank 0 writes the run's outputs
        return record
    record.jobs = list(outcome.results)
    record.spans = list(outcome.spans)
    record.metrics.update(outcome.metrics)
    record.info = dataclasses.replace(info, jobs=tuple(r.job for r in record.jobs))
    record.telemetry_note = "cluster run: per-rank timelines are in trace.json"
    record.plugin_rows = list(outcome.plugin_rows) or plugin_rows(host, record.info)
    if len(record.jobs) > 1:
        _write_per_iteration(outcome.per_iteration, run_dir)
    _write_and_render(record, run_dir, console, refs)
    return record


def _write_per_iteration(rows: list[dict[str, Any]], run_dir: Path) -> None:
    """A multi-job cluster run's per-(job, worker, iteration) Mc/Pc/U/E/a."""
    import json

    with atomic_open(run_dir / "per_iteration.json") as handle:
        handle.write(json.dumps(rows, indent=1, default=str) + "\n")


__all__ = ["execute", "job_specs", "build_jobs", "pick_device", "memory_capacity", "JobResult"]
