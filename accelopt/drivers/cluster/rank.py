"""One process of a cluster run: joins the process group, activates its plugins and builds
every job of the workload exactly as a one-process run would (only each job's exchange
differs), walks the same lifecycle, runs the iterations the leader chooses
(``driver.py``), and reports back to rank 0."""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from accelopt.activation import PluginSet, activate
from accelopt.atomic import atomic_open
from accelopt.config import JobConfig, differing_keys
from accelopt.drivers.cluster.allreduce import AllReduce
from accelopt.drivers.cluster.carried import Carried
from accelopt.drivers.cluster.checkpoints import RankCheckpointer, restore_part
from accelopt.drivers.cluster.faults import Progress, is_communication_error
from accelopt.drivers.cluster.netns import tx_bytes
from accelopt.drivers.cluster.ps import ClusterExchange, PsServer, PsWorker
from accelopt.drivers.cluster.rendezvous import join_group
from accelopt.drivers.cluster.settings import BackendChoice, ClusterSettings, choose_backend
from accelopt.drivers.cluster.transport import Transport, TransportStats
from accelopt.drivers.lifecycle import Lifecycle
from accelopt.drivers.setup import RANK_THREADS, setup_torch
from accelopt.errors import ConfigError, UserError, raised_by_hook
from accelopt.host import HookTrace, hook_spans
from accelopt.job import Job, StepEvents, job_id_for, job_specs
from accelopt.job.checkpoint import plugin_settings
from accelopt.job.job import CHECK_INPUTS, described
from accelopt.job.timeline import PhaseTimer
from accelopt.plugin import Registry
from accelopt.records import Span
from accelopt.types import IterationResult, JobInfo, ReportRow, RunInfo
from accelopt.watchdog import HookWatchdog, watching
from accelopt.watchdog import log as watchdog_log


@dataclass
class JobPart:
    """One job as one rank saw it: sent to rank 0 with the rank's result."""

    rank: int
    role: str
    job: JobInfo
    backend: str = "gloo"
    iterations: list[dict[str, Any]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    stats: TransportStats = field(default_factory=TransportStats)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """The final parameters this rank owns (a server's shard; all-reduce: rank 0, all)."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    wire_bytes: list[tuple[int, int]] = field(default_factory=list)
    """(iteration, bytes the rank's interface had sent at its start): shaped runs only (the
    shared topology's ``lo`` counts every rank's traffic, a host's ``eth0`` its own)."""
    carried_s: float = 0.0
    """Resumed from a checkpoint: how long the job had run before it (from its arrival)."""
    carried_service_s: float = 0.0
    """Resumed: the job's service time before its checkpoint (first start to the checkpointed
    iteration's end, each earlier run's part on its own clock)."""
    carried_queueing_s: float | None = None
    """Resumed: the job's queueing delay before its checkpoint (``None``: it had not started)."""
    warnings: list[str] = field(default_factory=list)
    """What the job said it did other than its settings (``Job.warnings``): kept in
    ``metrics.json``'s run warnings, where a rank's log alone went unseen."""


def process_name(rank: int, role: str) -> str:
    """How a rank's process is named in the timeline and in its log lines."""
    return f"rank {rank} ({role})"


@dataclass
class RankResult:
    """Everything one rank measured, sent to rank 0 with ``gather_object``."""

    rank: int
    role: str
    pid: int
    device: str = "cpu"
    backend: str = "gloo"
    parts: dict[str, JobPart] = field(default_factory=dict)
    """job id -> that job on this rank (iterations, spans, transfer statistics, state)."""
    plugin_rows: list[ReportRow] = field(default_factory=list)
    job_scoped: list[str] = field(default_factory=list)
    """The job-scoped plugins: every rank's report rows of them count."""
    schedule: list[dict[str, Any]] = field(default_factory=list)
    """Leader only: every decision (time, chosen job id, lane)."""
    statuses: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Leader only: job id -> (status, error) as the leader's driver ended it."""
    train_t0: float | None = None
    """When training started (seconds since the run started); job arrivals count from here."""
    hook_spans: list[Span] = field(default_factory=list)
    """Every hook call this rank's plugins answered (``run.trace_hooks``), on the run's clock:
    the ``hooks`` track of this rank's process in the timeline."""

    @property
    def stats(self) -> TransportStats:
        """This rank's transport statistics over every job (one job: that job's)."""
        parts = list(self.parts.values())
        if len(parts) == 1:
            return parts[0].stats
        total = TransportStats()
        for part in parts:
            st = part.stats
            for key in ("transfers", "dropped", "payload_bytes", "header_bytes",
                        "logical_bytes", "ordered", "held", "inversions", "overtaken",
                        "partitioned", "chunks", "updated_early"):
                setattr(total, key, getattr(total, key) + getattr(st, key))
            for mine, theirs in ((total.bytes_by_iteration, st.bytes_by_iteration),
                                 (total.collective_bytes_by_iteration,
                                  st.collective_bytes_by_iteration)):
                for it, n in theirs.items():
                    mine[it] = mine.get(it, 0) + n
            total.started_log += st.started_log
            total.arrival_log += st.arrival_log
        return total


def pick_backend(settings: ClusterSettings, cfg: DictConfig) -> BackendChoice:
    """This rank's backend: :func:`choose_backend` for the ranks on this machine (torchrun's
    ``LOCAL_WORLD_SIZE``; a local run's ranks are all on this machine)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", settings.world_size))
    return choose_backend(settings, str(cfg.run.get("device", "auto")), local_ranks=local,
                          cuda_devices=torch.cuda.device_count())


class RankJob:
    """One job on this rank: the job (with its exchange), its transport and its timeline."""

    def __init__(self, spec: JobConfig, job_id: str, *, settings: ClusterSettings, rank: int,
                 device: torch.device, backend: str, plugins: PluginSet, t0_epoch: float,
                 group: Any, servers_group: Any, label: str,
                 exchange: Callable[[Transport], ClusterExchange] | None = None) -> None:
        """``exchange``: build this rank's exchange on the job's transport (default: the
        mode's, PS server/worker or all-reduce; a benchmark harness may bring its own)."""
        self.rank, self.t0_epoch, self.label = rank, t0_epoch, label
        self.role = settings.role(rank)
        self.workers = settings.workers
        self.process = process_name(rank, self.role)
        self.spans: list[Span] = []
        self.iterations: list[dict[str, Any]] = []
        self.wire_bytes: list[tuple[int, int]] = []
        self.wire = os.environ.get("GLOO_SOCKET_IFNAME", "lo") if settings.shaped else None
        """The interface whose sent bytes are this rank's traffic (a shaped run only)."""
        host = plugins.for_job(job_id)
        self.transport = Transport(rank=rank, host=host, t0_epoch=t0_epoch, process=self.process,
                                   timeout_s=settings.timeout_s, device=device, group=group)
        self.exchange: ClusterExchange
        if exchange is not None:
            self.exchange = exchange(self.transport)
        elif settings.mode == "ps":
            self.exchange = (PsServer(settings, rank, self.transport, servers_group)
                             if self.role == "server" else PsWorker(settings, rank, self.transport))
        else:
            self.exchange = AllReduce(settings, rank, self.transport)
        self.job = Job(spec, job_id=job_id, device=device, host=host, exchange=self.exchange,
                       bucket_bytes=settings.bucket_bytes, timer=PhaseTimer(self.span, self.now))
        self.backend = backend
        self._events: dict[str, StepEvents] = {}
        self.checkpointer: RankCheckpointer | None = None
        self.train_t0 = 0.0
        """When training started (seconds since the run started): arrivals count from it."""
        self.carried_s = 0.0
        """Resumed: the time the job had run before its checkpoint."""
        self.carried_service_s = 0.0
        """Resumed: the job's service time before its checkpoint."""
        self.carried_queueing_s: float | None = None
        """Resumed: the job's queueing delay before its checkpoint."""

    def elapsed_s(self) -> float:
        """How long this job has existed, from its arrival (a resumed job: since its arrival
        in the run it was resumed from)."""
        return max(0.0, self.now() - self.train_t0 - self.job.info.arrival_s) + self.carried_s

    def service_s(self) -> float:
        """The job's service time so far: its own iterations in this run added up (as one
        process adds up its iterations' spans; its first start to its latest end would count
        the time other jobs held the cluster in between), plus what the checkpoint it was
        resumed from carried (the carried rows' times are another run's clock, so they do
        not count here)."""
        own = [r for r in self.iterations if not r.get("carried")]
        return self.carried_service_s + sum(r["end_s"] - r["start_s"] for r in own)

    def queueing_s(self) -> float | None:
        """The job's queueing delay: its arrival to its first start (a resumed job: as its
        checkpoint carried it; ``None`` before it started)."""
        if self.carried_queueing_s is not None:
            return self.carried_queueing_s
        own = [r for r in self.iterations if not r.get("carried")]
        return own[0]["start_s"] - self.train_t0 - self.job.info.arrival_s if own else None

    def now(self) -> float:
        return time.time() - self.t0_epoch

    def span(self, name: str, track: str, start: float, end: float, category: str,
             **args: Any) -> None:
        self.spans.append(Span(name=self.label + name, track=track, start_s=start, end_s=end,
                               category=category, process=self.process,
                               args={"rank": self.rank, "job": self.job.info.job_id, **args}))

    def step(self, lane: str, progress: Progress | None) -> IterationResult:
        """Run this job's next iteration on this rank (what the leader chose)."""
        i = self.job.iteration
        if progress is not None:
            progress.set(i, self.job.info.job_id, self.job.info.name)
        if self.wire is not None:
            sent = tx_bytes(self.wire)
            if sent is not None:
                self.wire_bytes.append((i, sent))
        events = self._events.get(lane)
        if events is None:
            events = self._events[lane] = StepEvents(self.job.host, lane, time.time,
                                                      origin=self.t0_epoch)
        try:
            result = self.job.step(events)
        except Exception as exc:
            # a collective's error reached DDP's backward through the hook's future and came
            # out wrapped; raise the transport's own (one line, naming rank and bucket)
            if isinstance(exc, RuntimeError) and self.transport.failure is not None:
                raise self.transport.failure from None
            if i == 0 and self.role == "worker":
                self._name_the_rows(exc)
            raise
        # the iteration ends when the step returns: accelopt_iteration_end's plugins, which
        # run after the result was made, cost the job too (the local driver times it alike)
        end = self.now()
        self.span(f"iteration {i}", "iteration", result.start_s, end, "iteration",
                  iteration=i)
        self.iterations.append({"iteration": i, "start_s": result.start_s, "end_s": end,
                                "loss": result.loss, "samples": result.samples,
                                "weight": self.job.loss_share})
        if self.checkpointer is not None:
            self.checkpointer.after_step(self)
        return result

    def _name_the_rows(self, exc: Exception) -> None:
        """A worker's first iteration raised in the job's own code: the rows it was given go
        into the run's line (``faults.rank_error_text``), as a one-process run's first step says
        its batch. A worker trains its share of the batch, which a model may not take (a
        BatchNorm given one row: "Expected more than 1 value per channel")."""
        if isinstance(exc, UserError) or raised_by_hook(exc) or is_communication_error(exc):
            return
        try:
            x, y = self.job.batch(0)
            shown = (f"; this worker's rows of the batch: {described(x, y)} (batch_size "
                     f"{self.job.info.batch_size} over {self.workers} workers; "
                     f"{CHECK_INPUTS})")
            exc.accelopt_context = shown  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001, S110 - the rows are a hint; the error is the line
            pass

    def timeline(self) -> list[Span]:
        """This job's spans so far on this rank, its transfers tagged with the job id (a
        snapshot: another thread may still be adding to them)."""
        job_id = self.job.info.job_id
        transfers = [Span(s.name, s.track, s.start_s, s.end_s, s.category,
                          {**s.args, "job": job_id}, s.process)
                     for s in list(self.transport.spans)]
        return list(self.spans) + transfers

    def finish(self) -> JobPart:
        """Close the transport; this job's spans, transfer statistics and the state this
        rank owns."""
        self.job.close()
        params, buffers = self.exchange.final_state(self.job.model)
        return JobPart(rank=self.rank, role=self.role, job=self.job.info, backend=self.backend,
                       iterations=self.iterations, spans=self.timeline(),
                       stats=self.transport.stats, params=params, buffers=buffers,
                       wire_bytes=self.wire_bytes, carried_s=self.carried_s,
                       carried_service_s=self.carried_service_s,
                       carried_queueing_s=self.carried_queueing_s,
                       warnings=list(self.job.warnings))


@dataclass
class SoFar:
    """What a rank has run so far, for a run that stops before the rank reports (a peer
    failed, the launcher was stopped): its jobs' timelines, iteration records and hook
    calls, written by :meth:`write` where the launcher finds them, so a failed run's trace
    and losses show the iterations up to the failure instead of nothing."""

    jobs: list[RankJob] = field(default_factory=list)
    hook_calls: HookTrace = field(default_factory=list)
    hooks_shift: float = 0.0
    process: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _written: bool = False

    def write(self, results_dir: str | os.PathLike[str], rank: int) -> None:
        """Once per rank, from the rank's own failure or the launcher's request, whichever
        comes first; the other waits for it (a rank exiting mid-write would leave nothing).
        Best effort: the run's error is what matters."""
        with self._lock:
            if self._written:
                return
            self._written = True
            try:
                jobs = list(self.jobs)
                held = {part.job.info.job_id: model_param_bytes(part.exchange, part.job.model)
                        for part in jobs}
                left = RankSoFar(
                    rank, {part.job.info.job_id: part.timeline() for part in jobs},
                    {part.job.info.job_id: list(part.iterations) for part in jobs},
                    hook_spans(list(self.hook_calls), self.hooks_shift, self.process),
                    jobs[0].backend if jobs else "",
                    {job_id: n for job_id, n in held.items() if n is not None},
                    {part.job.info.job_id: n for part in jobs
                     if (n := trainable_bytes(part.job.info)) is not None})
                with atomic_open(so_far_path(results_dir, rank), "wb", durable=False) as fh:
                    pickle.dump(left, fh, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001, S110 - evidence is best effort
                pass


@dataclass
class RankSoFar:
    """One rank's :class:`SoFar` as written: each job's spans and iteration records, and
    the rank's hook calls."""

    rank: int
    job_spans: dict[str, list[Span]]
    iterations: dict[str, list[dict[str, Any]]]
    hook_spans: list[Span]
    backend: str = ""
    """The rank's process-group backend ("" unknown): the run's ``cluster_backend``."""
    param_bytes: dict[str, int] = field(default_factory=dict)
    """job id -> the bytes of the job's parameters, each tensor once: what a finished run's
    ``param_bytes`` counts (the servers' shards together, or all-reduce rank 0's whole
    model), known from the start and alike on every rank, so a stopped ps run gives its
    ``expected_bytes_per_iteration`` from any rank that left it; absent where the rank's
    exchange is not one of the cluster's own."""
    trainable_bytes: dict[str, int] = field(default_factory=dict)
    """job id -> the bytes of its parameters that require grad (the gradients a ps worker
    pushes), for the same figure."""


def model_param_bytes(exchange: Any, model: Any) -> int | None:
    """The bytes of ``model``'s parameters, each tensor once (a tied one once, as
    ``param_table`` lists it and the servers' shards hold it); ``None`` for an exchange
    that is not one of the cluster's own (its ``final_state``, which a finished run counts,
    may hold other tensors) or parameters not materialised (a lazy module)."""
    if not isinstance(exchange, (PsServer, PsWorker, AllReduce)):
        return None
    try:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    except Exception:  # noqa: BLE001 - an uninitialised parameter: unknown, not 0
        return None


def trainable_bytes(job: JobInfo) -> int | None:
    """The bytes of the parameters of ``job`` that required grad when it was built (its
    gradient buckets, each tensor once); ``None`` where its parameter table is not filled."""
    if not job.parameters:
        return None
    return sum(job.parameters[i].nbytes for bucket in job.buckets for i in bucket)


def so_far_path(results_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its timeline so far when the run stops (:class:`SoFar`)."""
    return Path(results_dir) / f"so-far-rank{rank}.pkl"


def read_so_far(results_dir: str | os.PathLike[str]) -> list[RankSoFar]:
    """What the ranks of a stopped run left, by rank (a rank killed outright left none)."""
    left: list[RankSoFar] = []
    for path in sorted(Path(results_dir).glob("so-far-rank*.pkl"),
                       key=lambda p: int(p.stem.removeprefix("so-far-rank"))):
        try:
            with open(path, "rb") as fh:
                left.append(pickle.load(fh))
        except Exception:  # noqa: BLE001, S112 - a rank killed while writing: skip it
            continue
    return left


def result_path(results_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its :class:`RankResult` (``run_rank(results_dir=...)``)."""
    return Path(results_dir) / f"results-rank{rank}.pkl"


def run_rank(cfg: DictConfig, settings: ClusterSettings, *, rank: int, world: int,
             t0_epoch: float, init_method: str, run_dir: str,
             progress: Progress | None = None,
             carried: Carried | None = None,
             results_dir: str | None = None,
             store_ready: Any | None = None,
             jobs_ended: Any | None = None,
             so_far: SoFar | None = None) -> list[RankResult] | None:
    """Run one rank to the end; rank 0 returns every rank's result, the others ``None``.

    ``results_dir``: a directory every rank can write (local ranks share the launcher's
    filesystem): each rank writes its own result there (:func:`result_path`) and returns
    ``None``; the launcher reads them all. That is ~0.15 s less where the user waits for the
    outputs than sending every result to rank 0, which would unpickle them only to pickle
    them all again for the launcher. Without it (torchrun: ranks on other machines) rank 0
    gathers them. ``store_ready``: the local ranks' rendezvous event (``rendezvous.py``).
    ``jobs_ended``: an event the leader sets once it has run the last iteration (the launcher
    starts its work for the outputs then). ``so_far``: filled with the rank's jobs and hook
    calls as they are built, for a run that stops before this rank reports."""
    from accelopt.drivers.cluster.driver import ClusterDriver

    setup_torch(cfg.run, default_threads=RANK_THREADS)
    backend = pick_backend(settings, cfg).backend
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    join_group(backend, init_method, rank=rank, world=world,
               timeout=timedelta(seconds=settings.timeout_s), store_ready=store_ready)
    # rank 0's clock is every rank's time origin; every rank's configuration must be rank
    # 0's (under torchrun each machine composes its own from its command line): each rank
    # sees them all, so every rank stops with the same line, none waits for a dead peer
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (t0_epoch, OmegaConf.to_container(cfg, resolve=True)))
    t0_epoch = float(gathered[0][0])
    other = next((r for r, (_, theirs) in enumerate(gathered) if theirs != gathered[0][1]), None)
    if other is not None:
        raise ConfigError(f"rank {other} was started with another configuration than rank 0 "
                          f"({differing_keys(gathered[0][1], gathered[other][1])} differ); "
                          "start every machine with the same accelopt command line")
    registry = Registry.discover()
    if carried is not None:
        carried.apply(registry)
    specs = job_specs(cfg)
    ids = [job_id_for(k, spec) for k, spec in enumerate(specs)]
    plugins = activate(cfg, registry, ids)
    hook_calls: HookTrace = []
    if cfg.run.trace_hooks:  # as a one-process run records them: a slow hook shows
        plugins.set_trace(hook_calls)
    # the hooks' clock (perf_counter) onto the run's (seconds since t0_epoch, every rank's)
    hooks_shift = time.time() - t0_epoch - time.perf_counter()
    role = settings.role(rank)
    process = process_name(rank, role)
    info = RunInfo(run_dir=run_dir, device=str(device), plugins=plugins.names, jobs=(),
                   seed=int(cfg.run.seed), rank=rank, role=role,  # type: ignore[arg-type]
                   world_size=world, leader=rank == 0, cluster=settings.info(backend))
    servers = settings.server_ranks()
    jobs: list[RankJob] = []
    for spec, job_id in zip(specs, ids, strict=True):
        # the run's timeout, not torch's 30 minutes: a collective whose end nobody waits
        # for with a deadline (a DDP bucket's future) still fails in time
        timeout = timedelta(seconds=settings.timeout_s)
        group = dist.new_group(ranks=list(range(world)), backend=backend, timeout=timeout)
        servers_group = (dist.new_group(ranks=servers, backend=backend, timeout=timeout)
                         if len(servers) > 1 else None)
        jobs.append(RankJob(spec, job_id, settings=settings, rank=rank, device=device,
                            backend=backend, plugins=plugins, t0_epoch=t0_epoch, group=group,
                            servers_group=servers_group,
                            label=f"{spec.name} " if len(specs) > 1 else ""))
    if so_far is not None:
        so_far.jobs, so_far.hook_calls = jobs, hook_calls
        so_far.hooks_shift, so_far.process = hooks_shift, process
    lifecycle = Lifecycle(plugins, info)
    lifecycle.job_built([j.job for j in jobs])
    every = int(cfg.run.get("checkpoint_every", 0) or 0)
    resume = cfg.run.get("resume")
    settings = plugin_settings(cfg) if every else None  # recorded in every checkpoint
    for part in jobs:
        if every:
            part.checkpointer = RankCheckpointer(run_dir, every, rank, world, settings)
        if resume:
            restore_part(str(resume), part, rank, world)
    lifecycle.start([j.job for j in jobs])
    driver = ClusterDriver(cfg, jobs, plugins, rank=rank, device=device, progress=progress,
                           clock=jobs[0].now)
    with _hook_watchdog(plugins.hook_code, float(cfg.run.hook_watchdog_s), process,
                        progress) as dog:
        try:
            driver.run()
        except Exception as exc:
            _name_blocked_hooks(exc, dog)
            raise
    if progress is not None:
        progress.jobs_ended()
    if jobs_ended is not None and rank == 0:
        jobs_ended.set()
    result = RankResult(rank=rank, role=role, pid=os.getpid(), device=str(device),
                        backend=backend, schedule=driver.schedule, statuses=driver.statuses,
                        train_t0=driver.train_t0, job_scoped=plugins.job_scoped)
    lifecycle.update([j.job for j in jobs])
    result.plugin_rows = lifecycle.rows()
    lifecycle.end({"rank": rank, "role": role,
                   "iterations": sum(len(j.iterations) for j in jobs)})
    for job in jobs:
        result.parts[job.job.info.job_id] = job.finish()
    result.hook_spans = hook_spans(hook_calls, hooks_shift, process)
    gathered: list[Any] | None = None
    if results_dir is not None:  # complete or absent; not durable: a scratch directory
        with atomic_open(result_path(results_dir, rank), "wb", durable=False) as fh:
            pickle.dump(result, fh, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
    dist.barrier()  # no rank leaves while another still sends (or writes its result)
    dist.destroy_process_group()
    return gathered  # type: ignore[return-value]


def _hook_watchdog(owners: Any, after_s: float, process: str,
                   progress: Progress | None) -> contextlib.AbstractContextManager[object]:
    """The rank's hook watchdog (``run.hook_watchdog_s``), whose lines also go beside the
    rank's progress, where the launcher reads them: a rank stuck in a hook never raises, and
    the run's line must name the hook (``faults.Watchdog``)."""
    if progress is None or after_s <= 0:
        return watching(owners, after_s, f"{process}: ")

    def say(line: str) -> None:
        watchdog_log.warning(line)
        progress.hook_blocked(line)

    return HookWatchdog(owners, after_s, where=f"{process}: ", say=say)


def _name_blocked_hooks(exc: Exception, dog: object) -> None:
    """Append to the rank's error line the plugin hook calls its watchdog reported and that
    still run (``faults.rank_error_text``): a hook that blocks is often why the rank's
    transfers timed out, and the timeout alone names no plugin."""
    if not isinstance(dog, HookWatchdog):
        return
    with contextlib.suppress(Exception):  # a hint must never replace the error
        blocked = dog.in_flight()
        if blocked:
            exc.accelopt_context = getattr(exc, "accelopt_context", "") + blocked  # type: ignore[attr-defined]
