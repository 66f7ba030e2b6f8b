"""Several jobs, each data-parallel in parameter-server mode, sharing one set of processes.

Every rank builds every job (its own model, parameter table, process group and transport,
so the transfers of two jobs can never match each other's tags) and then follows one
schedule: at every iteration boundary the **leader** (rank 0) decides which job runs the
next iteration and broadcasts the decision on the default process group; every rank, the
servers included, runs that iteration of that job and comes back for the next decision.
Because all ranks run the same sequence of (job, iteration) steps and each step is a
self-contained exchange inside the job's own group, no interleaving can deadlock.

Who decides: the ``accelopt_select_next`` hook of the run-level plugins (e.g. salus's
policy), asked on the leader with the jobs that have arrived and are unfinished. Without an
answer the earliest arrival runs (ties: job order) — one job at a time, to completion, in
arrival order: what a user gets submitting the jobs one by one to a PS cluster.

Plugins are split per process: those that implement a send/recv hook
(``accelopt_transfer_*``, e.g. tictac) get one instance *per job*, configured with a view of
the run config whose ``workload.jobs`` is that job alone (so a per-job plan is keyed by job
by construction); the others (e.g. salus) get one instance per rank and see every job's
iteration hooks.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from accelopt.cluster.rank import RankResult, RankRuntime
from accelopt.config import JobConfig
from accelopt.errors import PluginHookError
from accelopt.hookspecs import TRANSFER_HOOKS
from accelopt.host import PluginHost
from accelopt.plugin import Registry, resolve
from accelopt.runtime.activation import activate, selected_plugins
from accelopt.types import JobState, ReportRow, RunInfo

LEADER = 0


def cluster_job_specs(cfg: DictConfig) -> list[JobConfig]:
    """The workload's jobs (explicit ones, then a generated trace), as a run would build."""
    from accelopt.config import AccelConfig
    from accelopt.runtime.run import job_specs

    typed = OmegaConf.merge(OmegaConf.structured(AccelConfig),
                            {"workload": OmegaConf.to_container(cfg.workload, resolve=True)})
    return job_specs(typed)  # type: ignore[arg-type]


def job_id_for(index: int, spec: JobConfig) -> str:
    return f"{index:02d}-{spec.name}"


def job_view(cfg: DictConfig, spec: JobConfig, plugins: list[str]) -> DictConfig:
    """The run config as one job sees it: ``workload.jobs`` is that job alone, and only the
    named (per-job) plugins are selected."""
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    data["workload"]["jobs"] = [dataclasses.asdict(spec)]
    data["workload"].setdefault("generate", {})["n_jobs"] = 0
    data["plugins"] = {n: (data.get("plugins") or {}).get(n) or {} for n in plugins}
    return OmegaConf.create(data)


def split_plugins(cfg: DictConfig, registry: Registry) -> tuple[PluginHost, list[str]]:
    """(host of the run-level plugins, names of the per-job plugins)."""
    full = activate(cfg, registry)
    per_job = full.implementing(TRANSFER_HOOKS)
    specs = resolve(selected_plugins(cfg), registry)
    run_level = [(s, full.instances[s.name]) for s in specs if s.name not in per_job]
    return PluginHost(run_level), per_job


class Scheduler:
    """The leader's view: which jobs have arrived, how far each is, and who runs next."""

    def __init__(self, rts: list[RankRuntime], host: PluginHost, lane: str, train_t0: float,
                 now: Any, max_wait_s: float) -> None:
        self.rts = {rt.job.info.job_id: rt for rt in rts}
        self.order = list(self.rts)
        self.host, self.lane, self.train_t0, self.now = host, lane, train_t0, now
        self.max_wait_s = max_wait_s
        self.done = dict.fromkeys(self.order, 0)
        self.service = dict.fromkeys(self.order, 0.0)
        self.last: dict[str, float | None] = dict.fromkeys(self.order)
        self.log: list[dict[str, Any]] = []
        self.decider = "fifo (run to completion, arrival order)"
        if host.implements("accelopt_select_next"):
            self.decider = "accelopt_select_next (" + ", ".join(host.names) + ")"

    def arrival(self, job_id: str) -> float:
        return self.rts[job_id].job.info.arrival_s

    def unfinished(self) -> list[str]:
        return [j for j in self.order if self.done[j] < self.rts[j].job.info.iterations]

    def decide(self) -> dict[str, Any]:
        """``{"run": [job_id]}``, ``{"wait": seconds}`` (nothing has arrived yet; the leader
        slept that long) or ``{"stop": True}``."""
        left = self.unfinished()
        if not left:
            return {"stop": True}
        elapsed = self.now() - self.train_t0
        ready = [j for j in left if self.arrival(j) <= elapsed]
        if not ready:
            gap = min(self.arrival(j) for j in left) - elapsed
            pause = max(0.0, min(gap, self.max_wait_s))
            time.sleep(pause)  # real-time arrivals: the trace says nothing has arrived yet
            return {"wait": pause}
        chosen = None
        if self.host.implements("accelopt_select_next"):
            states = [self._state(j) for j in ready]
            chosen = self.host.call("accelopt_select_next", lane=self.lane, ready=states,
                                    now_s=self.now())
            if chosen is not None and chosen not in ready:
                raise PluginHookError(", ".join(self.host.names), "accelopt_select_next", ValueError(
                    f"chose {chosen!r}, which is not one of the ready jobs {ready}"))
        if chosen is None:
            chosen = min(ready, key=lambda j: (self.arrival(j), self.order.index(j)))
        self.log.append({"t_s": elapsed, "run": [chosen], "ready": ready})
        return {"run": [chosen]}

    def _state(self, job_id: str) -> JobState:
        return JobState(job=self.rts[job_id].job.info, lane=self.lane,
                        iterations_done=self.done[job_id], service_seconds=self.service[job_id],
                        last_iteration_seconds=self.last[job_id],
                        admitted_at_s=self.train_t0 + self.arrival(job_id))

    def observe(self, job_id: str, seconds: float) -> None:
        self.done[job_id] += 1
        self.service[job_id] += seconds
        self.last[job_id] = seconds


def _steps(rt: RankRuntime) -> Iterator[int]:
    from accelopt.cluster import ps

    return ps.server_steps(rt) if rt.role == "server" else ps.worker_steps(rt)


def run_jobs(cfg: DictConfig, settings: Any, specs: list[JobConfig], *, rank: int, world: int,
             t0_epoch: float, device: Any, backend: str, run_dir: str,
             progress: Any = None) -> RankResult:
    """This rank's part of a multi-job PS run (the process group already exists)."""
    registry = Registry.discover()
    run_host, per_job = split_plugins(cfg, registry)
    lock = threading.Lock()
    rts: list[RankRuntime] = []
    for k, spec in enumerate(specs):
        group = dist.new_group(ranks=list(range(world)), backend=backend)
        view = job_view(cfg, spec, per_job)
        job_id = job_id_for(k, spec)
        rt = RankRuntime(view, settings, rank, world, t0_epoch, device, backend,
                         f"{run_dir}/jobs/{job_id}", progress,
                         host=activate(view, registry), spec=spec, job_id=job_id, group=group,
                         run_host=run_host, run_lock=lock)
        rt.label = f"{spec.name} "
        rts.append(rt)
    process = rts[0].process
    run_info = RunInfo(run_dir=run_dir, device=str(device), plugins=tuple(
        [*run_host.names, *per_job]), jobs=tuple(rt.job.info for rt in rts),
        seed=int(cfg.run.seed))
    run_host.call("accelopt_run_start", run=run_info)
    for rt in rts:
        rt.host.call("accelopt_run_start", run=rt.run_info)

    dist.barrier()  # every rank has built every job: the trace's clock starts now
    box: list[Any] = [rts[0].now()]
    dist.broadcast_object_list(box, src=LEADER)
    train_t0 = float(box[0])
    steps = {rt.job.info.job_id: _steps(rt) for rt in rts}
    by_id = {rt.job.info.job_id: rt for rt in rts}
    scheduler = (Scheduler(rts, run_host, process, train_t0, rts[0].now,
                           max(0.05, settings.timeout_s / 4)) if rank == LEADER else None)
    while True:
        box = [scheduler.decide() if scheduler is not None else None]
        dist.broadcast_object_list(box, src=LEADER)
        decision = box[0]
        if decision.get("stop"):
            break
        for job_id in decision.get("run", []):
            t = time.perf_counter()
            next(steps[job_id])
            if scheduler is not None:
                scheduler.observe(job_id, time.perf_counter() - t)
            rt = by_id[job_id]
            if len(rt.result.iterations) == rt.job.info.iterations:
                for _ in steps[job_id]:  # runs the loop's tail (keeps the final parameters)
                    raise RuntimeError(f"job {job_id} ran past its last iteration")

    out = RankResult(rank=rank, role=rts[0].role, pid=rts[0].result.pid, job=rts[0].job.info,
                     device=str(device), backend=backend, train_t0=train_t0)
    rows: list[ReportRow] = []
    for answer in run_host.call("accelopt_report_rows", run=run_info) or []:
        rows.extend(answer if isinstance(answer, list) else [answer])
    for rt in rts:
        for answer in rt.host.call("accelopt_report_rows", run=rt.run_info) or []:
            for row in answer if isinstance(answer, list) else [answer]:
                rows.append(dataclasses.replace(
                    row, metrics={**row.metrics, "job": rt.spec.name}))
        rt.host.call("accelopt_run_end", run=rt.run_info,
                     metrics={"rank": rank, "role": rt.role, "job": rt.job.info.job_id})
        out.parts[rt.job.info.job_id] = rt.finish_job()
    run_host.call("accelopt_run_end", run=run_info, metrics={"rank": rank, "role": out.role})
    out.plugin_rows = rows
    out.spans = []
    if scheduler is not None:
        out.schedule = scheduler.log
    return out


def representative_rows(rows_by_rank: list[list[ReportRow]], roles: list[str],
                        per_job: Callable[[ReportRow], bool]) -> list[list[ReportRow]]:
    """Keep one rank's view of each run-level plugin's rows.

    Per-job plugins (tictac, gradcomm: ``per_job(row)`` is true) act on each job's transfers;
    every rank's rows of them are kept (a server's plan and a worker's view differ).
    Run-level plugins (gpu_kernels, offload, salus) run once per rank and would repeat
    themselves on every rank, with a parameter server saying "nothing to do" because it never
    runs forward. Their rows are taken from the first worker that reported the plugin, else
    from the first rank that did (salus reports on the leader only)."""
    order = sorted(range(len(rows_by_rank)), key=lambda i: roles[i] != "worker")
    source: dict[str, int] = {}
    for i in order:
        for row in rows_by_rank[i]:
            if not per_job(row):
                source.setdefault(row.plugin, i)
    return [[r for r in rows if per_job(r) or source.get(r.plugin) == i]
            for i, rows in enumerate(rows_by_rank)]


def tagged_with(job_names: list[str]) -> Callable[[ReportRow], bool]:
    """``per_job`` for :func:`representative_rows` in a multi-job run: each job's host tags
    its per-job plugins' rows with the job's name (``metrics["job"]``)."""
    return lambda row: (row.metrics or {}).get("job") in job_names


def merge_rows(rows_by_rank: list[list[ReportRow]], job_names: list[str],
               job_ids: list[str] | None = None) -> list[ReportRow]:
    """One row per (plugin, summary): per-job rows (tagged ``metrics["job"]``, with the job's
    name or its id: run-level plugins such as gpu_kernels tag rows with job ids) that say the
    same for several jobs collapse into one row naming them ("all jobs" when every job)."""
    name_of = dict(zip(job_ids or [], job_names, strict=False))

    def rank_of(job: str) -> int:
        return job_names.index(job) if job in job_names else len(job_names)

    groups: dict[tuple[str, str], list[Any]] = {}
    order: list[tuple[str, str]] = []
    for rows in rows_by_rank:
        for row in rows:
            job = row.metrics.get("job") if row.metrics else None
            summary = row.summary
            if job in name_of and summary.startswith(f"{job}: "):
                summary = summary[len(job) + 2:]  # named by id; the merged row names it once
            key = (row.plugin, summary)
            if key not in groups:
                groups[key] = [dataclasses.replace(row, summary=summary), []]
                order.append(key)
            job = name_of.get(job, job) if job is not None else None
            if job is not None and job not in groups[key][1]:
                groups[key][1].append(job)
    out = []
    for key in order:
        row, jobs = groups[key]
        if jobs:
            who = ("all jobs" if len(jobs) == len(job_names) and len(jobs) > 1
                   else "job " + ", ".join(sorted(jobs, key=rank_of)))
            metrics = {k: v for k, v in row.metrics.items() if k != "job"}
            row = ReportRow(row.plugin, f"{who}: {row.summary}", metrics)
        out.append(row)
    return out
