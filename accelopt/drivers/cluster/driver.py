"""The cluster driver: every rank runs the same sequence of (job, iteration) steps, decided by
the leader with the same local driver a one-process run uses.

Every rank builds every job (its own model, exchange, transport and process group, so the
transfers of two jobs can never match each other's tags). The **leader** (rank 0) runs the
:class:`~accelopt.drivers.local.Executor` over them: arrivals in real time, admission through
``accelopt_allocate``, the choice through ``choose_next`` (``accelopt_select_next``), the
release. Its stepper broadcasts each chosen (job, lane) on the default process group before
running its own part of the iteration; every other rank receives it and runs its part. All
ranks therefore run one iteration at a time, in the same order, and since each iteration is
a self-contained exchange inside the job's own group no interleaving can deadlock. Lanes a
plugin opens order iterations but do not run them concurrently here (the leader runs one
broadcast step at a time).

Without plugins the earliest arrival runs (ties: job order): one job at a time, to
completion, in arrival order, what a user gets submitting the jobs one by one.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from accelopt.activation import PluginSet
from accelopt.drivers.local import Executor
from accelopt.drivers.setup import memory_capacity
from accelopt.job import Job, StepEvents
from accelopt.records import JobResult
from accelopt.types import IterationResult

if TYPE_CHECKING:
    from accelopt.drivers.cluster.faults import Progress
    from accelopt.drivers.cluster.rank import RankJob

LEADER = 0


class ClusterDriver:
    """Runs this rank's part of every iteration the leader chooses."""

    def __init__(self, cfg: DictConfig, jobs: list[RankJob], plugins: PluginSet, *, rank: int,
                 device: torch.device, progress: Progress | None, clock: Any) -> None:
        self.cfg = cfg
        self.jobs = {j.job.info.job_id: j for j in jobs}
        self.plugins = plugins
        self.rank = rank
        self.device = device
        self.progress = progress
        self.clock = clock
        self.schedule: list[dict[str, Any]] = []
        self.statuses: dict[str, tuple[str, str]] = {}
        self.train_t0: float | None = None
        self._broadcast = threading.Lock()

    def run(self) -> None:
        dist.barrier()  # every rank has built every job: the trace's clock starts now
        box: list[Any] = [self.clock()]
        dist.broadcast_object_list(box, src=LEADER)
        self.train_t0 = float(box[0])
        for part in self.jobs.values():
            part.train_t0 = self.train_t0
        if self.rank == LEADER:
            self._lead()
        else:
            self._follow()

    # -- leader ------------------------------------------------------------------------------

    def _lead(self) -> None:
        executor = Executor(
            self.plugins, [j.job for j in self.jobs.values()],
            capacity_bytes=memory_capacity(str(self.cfg.run.get("memory_capacity", "auto")),
                                           self.device),
            device=str(self.device), profiler=None, stepper=self._lead_step,
            clock=self.clock, jobs_fail_alone=False, results=self._resumed(),
        )
        results = executor.run()  # an error ends this rank; the watchdog stops the others
        self._send({"stop": True})
        self.statuses = {r.job.job_id: (r.status, r.error) for r in results}

    def _resumed(self) -> dict[str, JobResult]:
        """The jobs a checkpoint brought back part-way (or finished): the executor goes on
        from their iteration (a finished one does not run again)."""
        out = {}
        for job_id, part in self.jobs.items():
            job = part.job
            if job.iteration:
                out[job_id] = JobResult(job.info, status="done" if job.done else "pending",
                                        iterations_done=job.iteration)
        return out

    def _lead_step(self, job: Job, events: StepEvents) -> IterationResult:
        with self._broadcast:  # one broadcast step at a time, whatever the lanes
            job_id = job.info.job_id
            self.schedule.append({"t_s": self.clock() - (self.train_t0 or 0.0), "run": [job_id],
                                  "lane": events.lane})
            self._send({"run": job_id, "lane": events.lane})
            return self.jobs[job_id].step(events.lane, self.progress)

    def _send(self, decision: dict[str, Any]) -> None:
        dist.broadcast_object_list([decision], src=LEADER)

    # -- followers ---------------------------------------------------------------------------

    def _follow(self) -> None:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=LEADER)
            decision = box[0]
            if decision.get("stop"):
                return
            self.jobs[decision["run"]].step(decision["lane"], self.progress)
