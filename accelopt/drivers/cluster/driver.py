"""The cluster driver: every rank runs the same sequence of (job, iteration) steps, decided by
the leader with the same local driver a one-process run uses.

Every rank builds every job (its own model, exchange, transport and process group, so the
transfers of two jobs can never match each other's tags). The **leader** (rank 0) runs the
:class:`~accelopt.drivers.local.Executor` over them: arrivals in real time, admission through
``accelopt_allocate``, the choice through ``choose_next`` (``accelopt_select_next``), the
release. Its stepper broadcasts each chosen (job, lane) on the default process group before
running its own part of the iteration (three integers: the job's index, the lane's index in
a table every rank grows in the same order, and whether the lane is new, whose name then
follows once as an object); every other rank receives it and runs its part. All
ranks therefore run one iteration at a time, in the same order, and since each iteration is
a self-contained exchange inside the job's own group no interleaving can deadlock. Lanes a
plugin opens order iterations but do not run them concurrently here (the leader runs one
broadcast step at a time).

Without plugins the earliest arrival runs (ties: job order): one job at a time, to
completion, in arrival order, what a user gets submitting the jobs one by one.

With several jobs the decision is broadcast before every iteration, even where no plugin
decides: it is also the point where every rank starts the iteration together. It is three
integers in one tensor broadcast (~0.7 ms on gloo over loopback) rather than a pickled
object (``broadcast_object_list``: two collectives and a pickle round trip, ~1.7 ms).

A run of **one job** has nothing to decide after its first iteration: the leader broadcasts
that decision once, marked *free-running*, and every other rank then runs the job's
remaining iterations without waiting for the leader between them (its exchange still
synchronises the data: a PS worker's forward waits for each layer's parameters, an
all-reduce for every rank's buckets). Why: the leader of a PS run is a server, whose
iteration ends only once every gradient is in; a per-iteration broadcast would hold every
worker's next forward until then, which is exactly what cross-iteration scheduling (the
early update, tictac's ``priority``) overlaps.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from accelopt.activation import PluginSet
from accelopt.drivers.cluster.faults import record_ended
from accelopt.drivers.local import Executor
from accelopt.drivers.setup import memory_capacity
from accelopt.job import Job, StepEvents
from accelopt.records import JobResult
from accelopt.types import IterationResult

if TYPE_CHECKING:
    from accelopt.drivers.cluster.faults import Progress
    from accelopt.drivers.cluster.rank import RankJob

LEADER = 0
FREE = 2
"""Decision flag: run the job's remaining iterations without waiting for more decisions."""


def on_training_clock(result: JobResult, train_t0: float | None) -> JobResult:
    """``result`` (measured on the ranks' clock, which starts with the launcher) moved onto
    the training clock, whose 0 is ``train_t0``, when every rank had built every job, in
    place: its admission, first start and end move ``train_t0`` earlier, and its arrival
    stays the one it has (as configured, or on a resumed run's clock:
    ``checkpoints.restore_part``). So ``arrival_s`` in ``metrics.json`` means what it
    means in one process (the configured arrival, counted from when training could start),
    JCT and queueing delay exclude process start-up, and a resumed job that had arrived
    before the stop is at a negative arrival whatever either run's start-up took: the
    checkpoints' clock (``RankCheckpointer.after_step``) counts from ``train_t0`` too. On
    the ranks' clock (``train_t0`` + arrival) a job configured at 0 would arrive after the
    start-up, and a resumed job's sign would depend on how long the resumed run took to
    start. ``None``: no training clock (nothing moves)."""
    shift = float(train_t0 or 0.0)
    for name in ("admitted_s", "first_start_s", "end_s"):
        value = getattr(result, name)
        if value is not None:
            setattr(result, name, value - shift)
    return result


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
        self._ended_jobs: dict[str, dict[str, Any]] = {}
        self._first_started: set[str] = set()
        """The jobs whose first iteration in this run the leader has recorded
        (:meth:`_started`)."""
        self._service: dict[str, float] = {}
        """Leader: each job's service time so far, carried part included (:meth:`_served`)."""
        self._ended_lock = threading.Lock()
        """Held while ``_ended_jobs`` changes and is written: lanes end and switch jobs on
        threads of their own, and two writing ``ended.json`` at once failed the run."""
        self.train_t0: float | None = None
        self._broadcast = threading.Lock()
        self._ids = list(self.jobs)
        """Job ids in build order, the same on every rank (the decision names an index)."""
        self._index = {job_id: k for k, job_id in enumerate(self._ids)}
        self._lanes: list[str] = []
        self._lane_index: dict[str, int] = {}
        self._decision_device = device
        """Where the decision tensor lives: the rank's device, which is CUDA exactly when the
        process group is NCCL (``rank.py`` picks them together)."""

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
            on_finish=self._ended if self.progress is not None else None,
        )
        results = executor.run()  # an error ends this rank; the watchdog stops the others
        self._send({"stop": True})
        self.statuses = {r.job.job_id: (r.status, r.error) for r in results}

    def _ended(self, job: Job, result: JobResult) -> None:
        """A job's end, recorded where the launcher finds it if the run stops later: JCT and
        queueing delay from its arrival counted as a successful run counts it (on the
        training clock, so without process start-up: :func:`on_training_clock`), its
        service time (as the leader saw it: :meth:`_served`) and samples (the global batch
        per iteration). A stopped run's report puts the job at its arrival plus these, on
        the same training clock as a successful run's."""
        timed = on_training_clock(dataclasses.replace(result, job=job.info), self.train_t0)
        with self._ended_lock:
            self._ended_jobs[job.info.job_id] = {
                "status": result.status, "error": result.error,
                "iterations": result.iterations_done, "jct_s": timed.jct_s,
                "queueing_s": timed.queueing_s, "service_s": self._service_s(job.info.job_id),
                "samples": result.iterations_done * job.info.batch_size}
            self._record()

    def _switched(self, job_id: str) -> None:
        """The leader switches to ``job_id``: the job it leaves and the one it takes are
        recorded with the iterations they have run (the one taken marked ``current``), so a
        run stopped later tells how far each unfinished job got (a rank's progress file
        holds only the iteration it is in, of whichever job)."""
        with self._ended_lock:
            for other, current in ((self._current, False), (job_id, True)):
                if self._running(other):
                    self._ended_jobs[other] = self._so_far(other, current)  # type: ignore[arg-type]
            self._current = job_id
            self._record()

    def _running(self, job_id: str | None) -> bool:
        """``job_id`` is a job that has not ended (its record, if any, says ``running``)."""
        return job_id is not None and self._ended_jobs.get(job_id, {}).get(
            "status", "running") == "running"

    def _so_far(self, job_id: str, current: bool) -> dict[str, Any]:
        """An unfinished job's record: its iterations, and its queueing delay (``None``
        before its first start) and service time so far, as :meth:`_ended` records a
        finished job's, so a stopped run's report gives it a first start and samples/s as
        one process does (its first start is on the training clock: the queueing delay
        counts from the arrival after every rank had built every job)."""
        part = self.jobs[job_id]
        return {"status": "running", "current": current, "iterations": part.job.iteration,
                "queueing_s": part.queueing_s(), "service_s": self._service_s(job_id),
                "carried_service_s": part.carried_service_s}

    def _started(self, job_id: str) -> None:
        """The job the leader runs has its first start in this run: its record gets the
        queueing delay (one file write per job; the switch that took it came before)."""
        with self._ended_lock:
            if (self._running(job_id) and job_id in self._ended_jobs
                    and self._ended_jobs[job_id].get("queueing_s") is None):
                self._ended_jobs[job_id] = self._so_far(
                    job_id, bool(self._ended_jobs[job_id].get("current")))
                self._record()

    def _record(self) -> None:
        if self.progress is not None:
            record_ended(self.progress.path.parent, self._ended_jobs)

    def _resumed(self) -> dict[str, JobResult]:
        """The jobs a checkpoint brought back part-way (or finished): the executor goes on
        from their iteration (a finished one does not run again)."""
        out = {}
        for job_id, part in self.jobs.items():
            job = part.job
            if job.iteration:
                out[job_id] = JobResult(job.info, status="done" if job.done else "pending",
                                        iterations_done=job.iteration, carried_s=part.carried_s)
        return out

    def _lead_step(self, job: Job, events: StepEvents) -> IterationResult:
        with self._broadcast:  # one broadcast step at a time, whatever the lanes
            job_id = job.info.job_id
            self.schedule.append({"t_s": self.clock() - (self.train_t0 or 0.0), "run": [job_id],
                                  "lane": events.lane})
            if job_id != self._current:  # a switch: one small file write, not per iteration
                self._switched(job_id)
            if not self._freed:
                self._freed = len(self.jobs) == 1  # one job: the followers run on by themselves
                self._send({"run": job_id, "lane": events.lane, "free": self._freed})
            result = self.jobs[job_id].step(events.lane, self.progress)
            if self.progress is not None:
                self._served(job_id)
                if job_id not in self._first_started:
                    self._first_started.add(job_id)  # once per job, not a lock every iteration
                    self._started(job_id)
            return result

    def _served(self, job_id: str) -> None:
        """The job's iterations and service time so far, after each of its iterations, where
        the launcher reads them if the run stops with its ranks
        (:meth:`~accelopt.drivers.cluster.faults.Progress.served`): the job's record in
        ``ended.json`` is written at its switches and first start only (one file write
        per job), and a run of one job stopped later gave it one iteration's time.

        The leader's iterations of a job that follow each other count from the previous
        one's end, not their own start: the time between two of them is that job's (no
        other job ran between), whatever part of each iteration the leader's own span
        covers (a parameter server's is its own part of it), so the figure is the time the
        job's iterations took on the cluster, give or take the part of the first one before
        the leader's. Added up here one iteration at a time (``RankJob.service_s`` sums
        every record: a cost per iteration that grows with the job)."""
        part = self.jobs[job_id]
        last = part.iterations[-1]
        begun = last["start_s"]
        if self._previous is not None and self._previous[0] == job_id:
            begun = min(begun, self._previous[1])
        self._previous = (job_id, last["end_s"])
        so_far = self._service.get(job_id, part.carried_service_s) + last["end_s"] - begun
        self._service[job_id] = so_far
        self.progress.served(job_id, part.job.iteration, so_far)  # type: ignore[union-attr]

    def _service_s(self, job_id: str) -> float:
        """The job's service time so far as the leader saw it (:meth:`_served`; the job's
        own iterations added up before it has run one here)."""
        return self._service.get(job_id, self.jobs[job_id].service_s())

    _previous: tuple[str, float] | None = None
    """The leader's last iteration: its job and its end (:meth:`_served`)."""

    _current: str | None = None
    """The job the leader ran last (a switch away from it records how far it got)."""

    _freed = False
    """The one job's followers were told to run its remaining iterations by themselves."""

    def _send(self, decision: dict[str, Any]) -> None:
        """Broadcast one decision: ``{"run": job_id, "lane": lane, "free": bool}`` or
        ``{"stop": True}``. A per-iteration message, so it is one small tensor broadcast,
        not a pickled object (which costs two collectives and a pickle round trip)."""
        if decision.get("stop"):
            self._broadcast_codes(-1, -1, 0)
            return
        lane = str(decision["lane"])
        index = self._lane_index.get(lane)
        new = index is None
        if index is None:
            index = self._add_lane(lane)
        self._broadcast_codes(self._index[decision["run"]], index,
                              int(new) | (FREE if decision.get("free") else 0))
        if new:
            dist.broadcast_object_list([lane], src=LEADER)

    def _receive(self) -> dict[str, Any]:
        job, lane, flags = self._broadcast_codes()
        if job < 0:
            return {"stop": True}
        if flags & 1:  # a lane not seen before: its name follows
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=LEADER)
            self._add_lane(str(box[0]))
        return {"run": self._ids[job], "lane": self._lanes[lane], "free": bool(flags & FREE)}

    def _add_lane(self, lane: str) -> int:
        self._lane_index[lane] = len(self._lanes)
        self._lanes.append(lane)
        return self._lane_index[lane]

    def _broadcast_codes(self, *codes: int) -> tuple[int, int, int]:
        """The leader's three integers (job index, lane index, whether the lane is new), on
        every rank."""
        box = (torch.tensor(codes, dtype=torch.int64, device=self._decision_device) if codes
               else torch.empty(3, dtype=torch.int64, device=self._decision_device))
        dist.broadcast(box, src=LEADER)
        job, lane, new = (int(v) for v in box.tolist())
        return job, lane, new

    # -- followers ---------------------------------------------------------------------------

    def _follow(self) -> None:
        while True:
            decision = self._receive()
            if decision.get("stop"):
                return
            part = self.jobs[decision["run"]]
            part.step(decision["lane"], self.progress)
            while decision["free"] and not part.job.done:
                part.step(decision["lane"], self.progress)
