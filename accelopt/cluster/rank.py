"""One process of a cluster run: joins the process group, builds the job and the active
plugins exactly as a single-process run would, runs its role, and reports back."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from accelopt.cluster.faults import Progress
from accelopt.cluster.model import param_table
from accelopt.cluster.netns import loopback_tx_bytes
from accelopt.cluster.settings import ClusterSettings
from accelopt.cluster.transport import Transport, TransportStats
from accelopt.config import JobConfig
from accelopt.hookspecs import TRANSFER_HOOKS
from accelopt.host import PluginHost
from accelopt.plugin import Registry
from accelopt.records import Span
from accelopt.runtime.activation import activate
from accelopt.runtime.job import Job, layer_build_hook
from accelopt.types import IterationContext, IterationResult, ReportRow, RunInfo


@dataclass
class RankResult:
    """Everything one rank measured, sent to rank 0 with ``gather_object``."""

    rank: int
    role: str
    pid: int
    job: Any  # JobInfo
    iterations: list[dict[str, Any]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    plugin_rows: list[ReportRow] = field(default_factory=list)
    stats: TransportStats = field(default_factory=TransportStats)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    loopback_bytes: list[tuple[int, int]] = field(default_factory=list)
    """(iteration, lo tx bytes at its start): only in a shaped run's private namespace."""
    device: str = "cpu"
    backend: str = "gloo"
    parts: dict[str, RankResult] = field(default_factory=dict)
    per_job_plugins: list[str] = field(default_factory=list)
    """The plugins that acted on this job's transfers (:data:`hookspecs.TRANSFER_HOOKS`):
    every rank's report rows of them count; other plugins' rows are kept from one rank."""
    """Multi-job run: one result per job (job id -> its iterations, spans, stats, params);
    the top level then holds the rank's plugin rows and, on the leader, the schedule."""
    schedule: list[dict[str, Any]] = field(default_factory=list)
    """Multi-job run, leader only: every decision (time, chosen job ids, policy)."""
    train_t0: float | None = None
    """Multi-job run: when training started (seconds since the run started); job arrival
    times count from here."""


def job_spec(cfg: DictConfig) -> JobConfig:
    jobs = cfg.workload.jobs
    if not jobs:
        from accelopt.errors import ConfigError

        raise ConfigError("workload.jobs is empty; a cluster run trains workload.jobs[0]")
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), jobs[0])
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def _specs(cfg: DictConfig) -> list[JobConfig]:
    """Every job of the workload (a single-job run keeps ``job_spec``'s path exactly)."""
    from accelopt.cluster.multijob import cluster_job_specs

    return cluster_job_specs(cfg)


def pick_backend(settings: ClusterSettings, cfg: DictConfig) -> str:
    if settings.backend != "auto":
        return settings.backend
    device = str(cfg.run.get("device", "auto"))
    return "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"


class Timer:
    """Compute spans on the rank's ``compute`` track; ``pause``/``resume`` cut a span where
    the rank waits (for parameters), so waiting never counts as compute."""

    def __init__(self, rt: RankRuntime) -> None:
        self.rt = rt
        self.name: str | None = None
        self.start = 0.0
        self.iteration = 0

    def begin(self, name: str, iteration: int) -> None:
        self.name, self.iteration, self.start = name, iteration, self.rt.now()

    def end(self) -> None:
        if self.name is not None:
            self.rt.span(self.name, "compute", self.start, self.rt.now(), "compute",
                         iteration=self.iteration)
        self.name = None

    def pause(self) -> str | None:
        name = self.name
        self.end()
        return name

    def resume(self, name: str | None) -> None:
        if name is not None:
            self.begin(name, self.iteration)


class RankRuntime:
    """The pieces every role uses: job, plugins, transport, timeline, hooks."""

    def __init__(self, cfg: DictConfig, settings: ClusterSettings, rank: int, world: int,
                 t0_epoch: float, device: torch.device, backend: str, run_dir: str,
                 progress: Progress | None, *, host: PluginHost | None = None,
                 spec: JobConfig | None = None, job_id: str | None = None,
                 group: Any = None, run_host: PluginHost | None = None,
                 run_lock: Any = None) -> None:
        """One job on this rank. A single-job run passes only the first arguments; a
        multi-job run (``cluster/multijob.py``) passes each job's own ``host`` (its
        transfer-hook plugins), ``spec``, ``job_id``, process ``group``, and the rank's
        ``run_host`` (the run-level plugins, e.g. a scheduler) that also gets the iteration
        hooks, under ``run_lock``."""
        self.cfg, self.settings, self.rank, self.world = cfg, settings, rank, world
        self.t0_epoch, self.device, self.backend = t0_epoch, device, backend
        self.role = settings.role(rank)
        self.process = f"rank {rank} ({self.role})"
        self.progress = progress
        self.host = host if host is not None else activate(cfg, Registry.discover())
        self.run_host = run_host
        self.run_lock = run_lock if run_lock is not None else contextlib.nullcontext()
        self.spec = spec if spec is not None else job_spec(cfg)
        self.job = Job(self.spec, job_id=job_id or self.spec.name, device=device,
                       layer_hook=layer_build_hook(*self.hosts()))
        self.table = param_table(self.job.model)
        self.transport = Transport(
            rank=rank, host=self.host, t0_epoch=t0_epoch, process=self.process,
            timeout_s=settings.timeout_s, device=device,
            tensor_ids={p.name: p.index for p in self.table}, group=group,
        )
        self.spans: list[Span] = []
        self.label = ""
        """Prefix of this job's span names (multi-job runs: the job's name)."""
        self.result = RankResult(rank=rank, role=self.role, pid=os.getpid(), job=self.job.info,
                                 device=str(device), backend=backend)
        self.run_info = RunInfo(run_dir=run_dir, device=str(device), plugins=self.host.names,
                                jobs=(self.job.info,), seed=int(cfg.run.seed))

    def hosts(self) -> list[PluginHost]:
        """The hosts whose plugins see this job's iteration hooks (each plugin once)."""
        return [self.host] + ([self.run_host] if self.run_host is not None else [])

    def now(self) -> float:
        return time.time() - self.t0_epoch

    def span(self, name: str, track: str, start: float, end: float, category: str,
             **args: Any) -> None:
        self.spans.append(Span(name=self.label + name, track=track, start_s=start, end_s=end,
                               category=category, process=self.process,
                               args={"rank": self.rank, "job": self.job.info.job_id, **args}))

    def iteration_start(self, i: int) -> tuple[float, IterationContext]:
        if self.progress is not None:
            self.progress.set(i)
        if self.settings.shaped:
            lo = loopback_tx_bytes()
            if lo is not None:
                self.result.loopback_bytes.append((i, lo))
        ctx = IterationContext(job=self.job.info, lane=self.process, iteration=i, now_s=self.now())
        with self.run_lock:
            for host in self.hosts():
                host.call("accelopt_iteration_start", context=ctx)
        return ctx.now_s, ctx

    def iteration_end(self, ctx: IterationContext, start: float, loss: float | None,
                      samples: int) -> None:
        end = self.now()
        i = ctx.iteration
        self.span(f"iteration {i}", "iteration", start, end, "iteration", iteration=i)
        self.result.iterations.append(
            {"iteration": i, "start_s": start, "end_s": end, "loss": loss, "samples": samples}
        )
        result = IterationResult(job_id=self.job.info.job_id, iteration=i, start_s=start,
                                 end_s=end, loss=loss, samples=samples)
        with self.run_lock:
            for host in self.hosts():
                host.call("accelopt_iteration_end", context=ctx, result=result)

    def finish(self) -> RankResult:
        self.result.per_job_plugins = self.host.implementing(TRANSFER_HOOKS)
        rows = self.host.call("accelopt_report_rows", run=self.run_info) or []
        for answer in rows:
            self.result.plugin_rows.extend(answer if isinstance(answer, list) else [answer])
        self.host.call("accelopt_run_end", run=self.run_info,
                       metrics={"rank": self.rank, "role": self.role})
        return self.finish_job()

    def finish_job(self) -> RankResult:
        """Close the transport and collect this job's spans (its transfers tagged with the
        job id) and transfer statistics."""
        self.transport.close()
        job_id = self.job.info.job_id
        transfers = [dataclasses.replace(s, args={**s.args, "job": job_id})
                     for s in self.transport.spans]
        self.result.spans = self.spans + transfers
        self.result.stats = self.transport.stats
        return self.result


def run_rank(cfg: DictConfig, settings: ClusterSettings, *, rank: int, world: int,
             t0_epoch: float, init_method: str, run_dir: str,
             progress: Progress | None = None) -> list[RankResult] | None:
    """Run one rank to the end; rank 0 returns every rank's result, the others ``None``."""
    from accelopt.cluster import allreduce, ps

    threads = int(cfg.run.get("threads", 0) or 0)
    torch.set_num_threads(threads if threads > 0 else 1)
    if bool(cfg.run.get("deterministic", True)):
        torch.use_deterministic_algorithms(True, warn_only=True)
    backend = pick_backend(settings, cfg)
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=settings.timeout_s))
    t0 = [t0_epoch]
    dist.broadcast_object_list(t0, src=0)  # one time origin for every rank's timeline
    torch.manual_seed(int(cfg.run.seed))
    specs = _specs(cfg)
    if len(specs) > 1:
        from accelopt.cluster.multijob import run_jobs

        result = run_jobs(cfg, settings, specs, rank=rank, world=world, t0_epoch=float(t0[0]),
                          device=device, backend=backend, run_dir=run_dir, progress=progress)
    else:
        rt = RankRuntime(cfg, settings, rank, world, float(t0[0]), device, backend, run_dir,
                         progress, spec=specs[0])
        rt.host.call("accelopt_run_start", run=rt.run_info)
        if settings.mode == "ps":
            (ps.run_server if rt.role == "server" else ps.run_worker)(rt)
        else:
            allreduce.run_worker(rt)
        result = rt.finish()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    dist.barrier()
    dist.destroy_process_group()
    return gathered  # type: ignore[return-value]
