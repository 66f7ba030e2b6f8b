"""The local driver (the executor): owns one device, admits jobs through the allocation hook
and runs their iterations, asking :func:`~accelopt.drivers.scheduling.choose_next` at every
iteration boundary which job goes next.

Concurrency model. Every admitted job sits in a *lane* (the allocation decision names it).
Each lane has one thread; iterations inside a lane run one at a time, lanes run
concurrently. The driver's bookkeeping and its own hook calls (allocation, release, the
choice) happen under its lock; ``Job.step`` runs outside it and fires the iteration's events
itself. Every hook call of the process is serialised by the host's lock, so plugins never
see two at once. Without plugins there is one lane, ``"default"``, and the default choice is
the earliest arrival: one job at a time, in arrival order, to completion (FIFO).

A cluster run's leader drives its jobs with this same class: its ``stepper`` broadcasts each
chosen iteration to the other ranks before running its own part (``drivers/cluster/
driver.py``), so allocation and scheduling mean the same thing in every mode.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from accelopt.activation import PluginSet, as_plugin_set
from accelopt.drivers.scheduling import arrival_key, choose_next
from accelopt.errors import UserError, listed, raised_by_hook
from accelopt.host import PluginHost
from accelopt.job import Job, StepEvents
from accelopt.job.job import first_step_failed
from accelopt.records import JobResult, Span
from accelopt.types import (
    AllocationDecision,
    AllocationRequest,
    IterationResult,
    JobInfo,
    JobProfile,
    JobState,
)
from accelopt.units import format_bytes, how_to_fit

DEFAULT_LANE = "default"
Profiler = Callable[[Job], JobProfile]
IterationCallback = Callable[[Job, JobResult], None]
Stepper = Callable[[Job, StepEvents], IterationResult]
"""Runs one iteration of a job: ``job.step(events)`` here; a cluster leader's broadcasts first."""


def local_step(job: Job, events: StepEvents) -> IterationResult:
    """The local driver's stepper: the job's own step."""
    return job.step(events)


CANCELLED = "cancelled by user"
ENDED = ("done", "failed", "rejected")
EXCLUSIVE = AllocationDecision(granted=True, lane=DEFAULT_LANE, reason="exclusive (default)")
"""The default decision when no plugin answers (immutable, so one object serves)."""
SIGNAL_CHECK_S = 0.25
"""The longest the thread in :meth:`Executor.run` waits without running Python. A signal
the kernel delivers to another thread (a lane's, busy on the CPU) runs its Python handler
only when the main thread next runs bytecode: with an unbounded wait there, a second Ctrl-C
to ``accelopt serve`` went unhandled until the running job ended (10^7 iterations: never)."""


def _number(job_id: str) -> int | None:
    """The number a job id starts with (``3`` for ``003-cnn``), None without one."""
    head = job_id.split("-", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass(eq=False)  # compared by identity: a lane's list is searched for the entry itself
class _Entry:
    job: Job
    result: JobResult
    lane: str = ""
    last_iteration_s: float | None = None
    busy: bool = False
    cancel_requested: bool = False
    finished: bool = False
    """Whether the job ended (done, failed or rejected); set by the driver with its status."""
    requests: dict[str, AllocationRequest] = field(default_factory=dict)
    """The job's allocation requests by phase (rebuilt when its record changes)."""
    events: StepEvents | None = None
    order: int = 0
    """The job's position in the executor's list (lanes keep their jobs in this order)."""

    def __post_init__(self) -> None:
        self.finished = self.result.status in ENDED  # a restored result may have ended

    def state(self) -> JobState:
        return JobState(
            job=self.job.info,
            lane=self.lane,
            iterations_done=self.job.iteration,
            service_seconds=self.result.service_s,
            last_iteration_seconds=self.last_iteration_s,
            admitted_at_s=self.result.admitted_s or 0.0,
        )


class Executor:
    """Runs a list of jobs to completion (or failure) under the active plugins."""

    def __init__(
        self,
        plugins: PluginSet | PluginHost,
        jobs: list[Job],
        *,
        capacity_bytes: int | None,
        device: str,
        profiler: Profiler | None = None,
        on_iteration: IterationCallback | None = None,
        on_finish: IterationCallback | None = None,
        results: dict[str, JobResult] | None = None,
        keep_open: bool = False,
        stepper: Stepper | None = None,
        clock: Callable[[], float] | None = None,
        jobs_fail_alone: bool = True,
        on_clock_start: Callable[[float], None] | None = None,
    ) -> None:
        """``clock``: seconds on a clock the caller shares (a cluster rank's run clock); by
        default the driver's own, starting at 0 when :meth:`run` starts (after the jobs are
        profiled): ``on_clock_start`` is then given that moment (``time.perf_counter()``),
        for a telemetry sampler whose samples must line up with the spans; it runs on the
        clock, so it must be cheap (the sampler probes its backend when it is made). Arrival times
        count from the start of :meth:`run` either way; a resumed run's job that had arrived
        before the run resumed stopped has a negative one (``job/checkpoint.py``:
        ``arrive_on_resumed_clock``): it is there from the start, in its arrival order. ``jobs_fail_alone=False`` turns an
        error of a job's own code into the end of the run (a cluster cannot go on without a
        rank's part of an iteration)."""
        self.plugins = plugins = as_plugin_set(plugins)
        self.host = plugins.run
        self.stepper = stepper
        """Runs one iteration (``None``: the job's own step, called directly)."""
        self._external_clock = clock is not None
        self._clock = clock or time.perf_counter
        self._origin = 0.0
        self._on_clock_start = on_clock_start
        self.clock_started: float | None = None
        """When :meth:`run` started the clock (``time.perf_counter()``; own clock only): the
        jobs' profiling comes before it."""
        self._jobs_fail_alone = jobs_fail_alone
        self._events: dict[tuple[str, str], StepEvents] = {}
        self.capacity_bytes = capacity_bytes
        self.device = device
        self.profiler = profiler
        self.on_iteration = on_iteration
        self.on_finish = on_finish
        self._lane_spans: list[tuple[str, str, float, float, int]] = []
        self._cv = threading.Condition()
        self._t0 = 0.0 if self._external_clock else self._clock()
        self._entries = {
            job.info.job_id: _Entry(job, (results or {}).get(job.info.job_id) or JobResult(job.info),
                                    order=order)
            for order, job in enumerate(jobs)
        }
        self._in_lane: dict[str, list[_Entry]] = {}
        """The admitted jobs of each lane that have not ended, in :attr:`_entries` order (what
        the lane chooses among, kept up to date instead of searched for every iteration)."""
        self._arrivals = sorted(
            (e for e in self._entries.values() if not e.finished),
            key=lambda e: arrival_key(e.job.info),
        )
        self._pending: list[_Entry] = []
        self._lanes: dict[str, threading.Thread] = {}
        self._inline = False
        """Whether the one lane runs on the thread that called :meth:`run` (see there)."""
        self._inline_lane: str | None = None
        """A lane admission opened, for :meth:`_drive` to run on its own thread."""
        self._serial_events = False
        """Whether the one lane's thread makes every hook call of the process (inline, and
        nothing moves between processes): the step's events skip the hook lock."""
        self._running = 0
        self._fatal: BaseException | None = None
        self._keep_open = keep_open
        self._closing = False
        self._inbox: list[_Entry] = []
        # torch's intra-op thread count is per OS thread under OpenMP: lane threads would
        # otherwise ignore run.threads and use the library default
        self._torch_threads = torch.get_num_threads()
        self._allocate_hook = self.host.bound("accelopt_allocate")

    # -- public --------------------------------------------------------------------------

    @property
    def spans(self) -> list[Span]:
        """Every iteration as a span on its lane's track (made on demand: the hot path only
        keeps tuples)."""
        return [Span(name=name, track=f"lane {lane}", start_s=start, end_s=end,
                     args={"job": name, "iteration": iteration})
                for name, lane, start, end, iteration in self._lane_spans]

    def now(self) -> float:
        return self._clock() - self._t0

    def run(self) -> list[JobResult]:
        """Drive arrivals and admissions until every job has finished; return the results.

        With ``keep_open=True`` (a long-lived service) it also takes jobs given to
        :meth:`submit` while it runs, and returns only after :meth:`close`.
        """
        # Profile before the clock starts (SALUS profiles offline): measuring one job must
        # not delay the admission of another, nor count in anybody's queueing delay.
        arrivals = [e for e in self._arrivals if self._profiled(e)]
        # One job, and no other can come: its lane runs on this thread, not a thread of its
        # own. Nothing could run beside it, and a second thread costs the job's tensors
        # glibc's per-thread arena (+0.3% of an MLP step's instructions,
        # benchmarks/overhead.py). With nothing moving between processes this thread is
        # then the only one that calls the process's hooks: the step's events skip the
        # hook lock (PluginHost.bound).
        self._inline = len(self._entries) == 1 and not self._keep_open
        self._serial_events = self._inline and all(  # no receiving or autograd-thread hooks
            e.job.exchange.role == "single" for e in self._entries.values())
        if self._serial_events:
            self._allocate_hook = self.host.bound("accelopt_allocate", serial=True)
        if self._external_clock:
            self._origin = self.now()
        else:
            with self._cv:  # submitted before the clock started (a service's ready callback):
                for entry in self._inbox:  # they arrive when it starts, as jobs at 0 do; their
                    # arrival on the old origin put them after their own end (a negative JCT)
                    entry.job.info = dataclasses.replace(entry.job.info, arrival_s=0.0)
                    entry.result.job = entry.job.info
            self._t0 = self.clock_started = self._clock()
            if self._on_clock_start is not None:  # on the clock: jobs arriving at 0 wait
                self._on_clock_start(self._t0)  # for it (a sampler probes when made)
        try:
            self._drive(arrivals)
        except BaseException as exc:  # Ctrl-C, SIGTERM (Terminated): the lanes stop too
            with self._cv:
                self._fatal = self._fatal or exc
                self._cv.notify_all()
        # every lane ends after its current iteration once the run is stopping: nothing trains
        # (or writes a checkpoint) after run() has returned or raised
        for thread in list(self._lanes.values()):
            while thread is not threading.current_thread() and thread.is_alive():
                thread.join(SIGNAL_CHECK_S)  # (not an inline lane that raised) see SIGNAL_CHECK_S
        if self._fatal is not None:
            raise self._fatal
        return [e.result for e in self._entries.values()]

    def _drive(self, arrivals: list[_Entry]) -> None:
        """Arrivals and admissions until every job has ended (or the run is stopping)."""
        while True:
            with self._cv:
                while arrivals and self._due(arrivals[0]) <= self.now():
                    self._pending.append(arrivals.pop(0))
                self._pending += self._inbox
                self._inbox = []
                if self._fatal is not None:
                    return
                self._admit_pending()
                inline, self._inline_lane = self._inline_lane, None
                if inline is None:
                    if self._inbox:
                        continue
                    if not arrivals and not self._lanes:
                        self._reject_unadmittable()
                        if not self._pending and (self._closing or not self._keep_open):
                            return
                    timeout = self._due(arrivals[0]) - self.now() if arrivals else None
                    if timeout is None or timeout > 0:
                        self._cv.wait(min(timeout or SIGNAL_CHECK_S, SIGNAL_CHECK_S))
            if inline is not None:
                self._lane_loop(inline)  # until the job ends (or the run stops)

    def _due(self, entry: _Entry) -> float:
        return self._origin + entry.job.info.arrival_s

    def submit(self, job: Job) -> None:
        """Hand a job to a running executor (thread-safe); it arrives now."""
        with self._cv:
            self._refuse_if_closing()
            if job.info.job_id in self._entries:
                raise UserError(f"a job with id {job.info.job_id!r} was already submitted")
        entry = _Entry(job, JobResult(job.info), order=len(self._entries))
        error = self._profile_error(entry)  # in the caller's thread, outside the lock
        if error is not None:  # refused, never accepted: no end recorded, no on_finish
            raise UserError(f"job {job.info.name!r} refused: {error}")
        with self._cv:
            # asked again with the add, under one lock: a close() during the profiling may
            # have let run() return, and a job added now would be accepted and never run
            self._refuse_if_closing()
            job.info = dataclasses.replace(job.info, arrival_s=self.now() - self._origin)
            entry.result.job = job.info
            self._entries[job.info.job_id] = entry
            self._inbox.append(entry)
            self._cv.notify_all()

    def _refuse_if_closing(self) -> None:
        """A submit after :meth:`close` is refused (called under the lock)."""
        if self._closing:
            raise UserError("the service is shutting down and accepts no new jobs; submit to "
                            "a new one")

    def _entry(self, job_id: str) -> _Entry:
        """The job ``job_id`` names: its id (``003-cnn``), or its number alone (``3``,
        ``003``), which is what a person reads off the status table and types."""
        entry = self._entries.get(job_id)
        if entry is None and job_id.isdigit():
            numbered = [e for jid, e in self._entries.items()
                        if _number(jid) == int(job_id)]
            entry = numbered[0] if len(numbered) == 1 else None
        if entry is None:
            raise UserError(f"no job {job_id!r}; known jobs: "
                            f"{listed(list(self._entries), 10) or 'none'}")
        return entry

    def cancel(self, job_id: str) -> str:
        """Cancel a job wherever it is (waiting, pending, between or inside an iteration);
        returns one line saying what happened. A running iteration is never interrupted:
        the job stops at its end."""
        with self._cv:
            entry = self._entry(job_id)
            job_id = entry.result.job.job_id
            if entry.finished:
                ended = "cancelled" if CANCELLED in entry.result.error else entry.result.status
                return f"{job_id} already {ended}"
            if entry in self._inbox:
                self._inbox.remove(entry)
                self._finish(entry, "failed", CANCELLED)
                return f"{job_id} cancelled before it arrived"
            if entry in self._pending:
                self._pending.remove(entry)
                self._finish(entry, "failed", CANCELLED)
                return f"{job_id} cancelled while waiting for memory"
            if not entry.busy and entry.lane:
                done, iterations = entry.result.iterations_done, entry.job.info.iterations
                self._finish(entry, "failed", CANCELLED)
                when = ("before it started" if done == 0 else
                        f"after {done} of {iterations} iteration{'' if iterations == 1 else 's'}")
                return f"{job_id} cancelled {when}; it left lane {entry.lane}"
            entry.cancel_requested = True
            return f"{job_id} will stop at the end of its current iteration"

    def wait(self, job_id: str, timeout_s: float) -> str:
        """Block until the job has ended or ``timeout_s`` passed; return its status. A
        timeout beyond ``threading.TIMEOUT_MAX`` (an inf, 1e10) waits that long: passed on,
        it raised OverflowError from the condition's wait."""
        deadline = time.monotonic() + min(timeout_s, threading.TIMEOUT_MAX)
        with self._cv:
            entry = self._entry(job_id)
            while not entry.finished and time.monotonic() < deadline:
                self._cv.wait(min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX))
            return entry.result.status

    def close(self, stop_now: BaseException | None = None) -> None:
        """Stop accepting jobs; :meth:`run` returns once the admitted ones have finished.

        ``stop_now`` (a second Ctrl-C or SIGTERM to a service) stops the run as that error
        would have: every lane ends after its current iteration and :meth:`run` raises it,
        the unended jobs left for the caller to mark. Safe from a signal handler of the
        thread in :meth:`run` (the lock is re-entrant, and a wait it is in wakes)."""
        with self._cv:
            self._closing = True
            if stop_now is not None:
                self._fatal = self._fatal or stop_now
            self._cv.notify_all()

    @property
    def lock(self) -> threading.Condition:
        """The lock every hook is called under: hold it to read state that plugins' hooks
        mutate (e.g. a lane table) consistently from another thread."""
        return self._cv

    def snapshot(self) -> list[tuple[JobInfo, JobResult, bool]]:
        """(job, result so far, iteration running now) for every job, consistently."""
        with self._cv:
            return [(e.job.info, e.result, e.busy) for e in self._entries.values()]

    # -- admission -----------------------------------------------------------------------

    def _profiled(self, entry: _Entry) -> bool:
        """Measure the job's profile if it has none; a job whose own code raises while
        being profiled fails alone (returns False)."""
        error = self._profile_error(entry)
        if error is not None:
            with self._cv:
                self._finish(entry, "failed", error, on_clock=False)
            return False
        return True

    def _profile_error(self, entry: _Entry) -> str | None:
        """Measure the job's profile if it has none; why it could not be (its own code
        raised), or None. Records nothing: a job of the run fails (:meth:`_profiled`), a
        job handed to :meth:`submit` is refused and leaves no trace."""
        if self.profiler is None or entry.job.info.profile is not None:
            return None
        try:
            entry.job.with_profile(self.profiler(entry.job))
        except Exception as exc:
            return first_step_failed(entry.job, exc)
        entry.result.job = entry.job.info
        return None

    def _admit_pending(self) -> None:
        """Offer every pending job to the allocation hook, in arrival order. A later small
        job may be admitted before an earlier large one that does not fit yet."""
        for entry in list(self._pending):
            decision = self._allocate(entry, "admission")
            if decision.reject is not None:
                self._pending.remove(entry)
                self._finish(entry, "rejected", decision.reject)
            elif decision.granted:
                self._pending.remove(entry)
                entry.lane = decision.lane
                entry.result.lane = decision.lane
                bisect.insort(self._in_lane.setdefault(entry.lane, []), entry,
                              key=lambda e: e.order)
                entry.result.admitted_s = self.now()
                self._start_lane(decision.lane)

    def _allocate(self, entry: _Entry, phase: str) -> AllocationDecision:
        request = entry.requests.get(phase)
        if request is None or request.job is not entry.job.info:  # made once per job record
            request = self._request(entry, phase)
        decision = self._allocate_hook(request) if self._allocate_hook else None
        if decision is not None:
            return decision
        if phase == "iteration":  # the default serves every iteration exclusively
            return EXCLUSIVE
        return self._default_allocation(request)

    def _request(self, entry: _Entry, phase: str) -> AllocationRequest:
        """The job's allocation request for ``phase``, made once per job record."""
        profile = entry.job.info.profile
        request = entry.requests[phase] = AllocationRequest(
            job=entry.job.info,
            phase=phase,  # type: ignore[arg-type]
            persistent_bytes=profile.persistent_bytes if profile else 0,
            ephemeral_bytes=profile.ephemeral_bytes if profile else 0,
            device=self.device,
            capacity_bytes=self.capacity_bytes,
        )
        return request

    def _default_allocation(self, request: AllocationRequest) -> AllocationDecision:
        need = request.persistent_bytes + request.ephemeral_bytes
        cap = request.capacity_bytes
        if request.phase == "admission" and cap is not None and need > cap:
            return AllocationDecision(
                granted=False,
                reject=(
                    f"job '{request.job.name}' needs {format_bytes(need)} (persistent + one "
                    f"iteration) but the device has {format_bytes(cap)}: "
                    f"{format_bytes(need - cap)} too much; "
                    + how_to_fit(request.persistent_bytes, request.ephemeral_bytes,
                                 "run.memory_capacity")
                ),
            )
        return EXCLUSIVE

    def _reject_unadmittable(self) -> None:
        """Nothing runs and nothing will arrive: a job still deferred would wait forever."""
        for entry in list(self._pending):
            self._pending.remove(entry)
            self._finish(
                entry,
                "rejected",
                "deferred by the allocation hook while the device was idle; it can never be "
                "admitted with the active plugins' memory settings",
            )

    # -- lanes ---------------------------------------------------------------------------

    def _start_lane(self, lane: str) -> None:
        if lane in self._lanes:
            self._cv.notify_all()
            return
        if self._inline:  # run() runs it, on its own thread
            self._lanes[lane] = threading.current_thread()
            self._inline_lane = lane
            return
        thread = threading.Thread(target=self._lane_loop, args=(lane,), name=f"lane-{lane}")
        self._lanes[lane] = thread
        thread.start()

    def _lane_loop(self, lane: str) -> None:
        """Run the lane's iterations until it has no job left (or the run stops). The
        driver's lock is held except around each step (and the per-iteration callback):
        once per iteration, for the last iteration's bookkeeping and the next choice."""
        torch.set_num_threads(self._torch_threads)
        cv = self._cv
        cv.acquire()
        try:
            while True:
                entry = self._next_in_lane(lane)
                if entry is None:
                    del self._lanes[lane]
                    cv.notify_all()
                    return
                if entry is _WAIT:
                    cv.wait()
                    continue
                entry.busy = True
                self._running += 1
                self._iterate(entry, lane)
        except BaseException as exc:  # a plugin bug or an interrupt: stop the whole run
            self._fatal = self._fatal or exc
            self._lanes.pop(lane, None)
            cv.notify_all()
        finally:
            cv.release()

    def _next_in_lane(self, lane: str) -> _Entry | object | None:
        ready = self._in_lane.get(lane)
        if not ready or self._fatal is not None:
            return None
        if len(ready) == 1:
            chosen = ready[0]
        else:
            job_id = choose_next(self.host, lane, [e.state() for e in ready], self.now())
            chosen = self._entries[job_id]
        allocate = self._allocate_hook
        if allocate is not None:  # _allocate's iteration case, inline: it runs every iteration
            request = chosen.requests.get("iteration")
            if request is None or request.job is not chosen.job.info:
                request = self._request(chosen, "iteration")
            decision = allocate(request) or EXCLUSIVE
            if not decision.granted:
                if self._running == 0:
                    self._finish(chosen, "failed", self._refused_alone(decision))
                    # nothing running will wake this lane: choose again now (waiting here
                    # hung the run, the driver waiting for this lane to end)
                    return self._next_in_lane(lane)
                return _WAIT
        return chosen

    def _refused_alone(self, decision: AllocationDecision) -> str:
        """Why a job failed whose iteration was refused while nothing else ran (nothing would
        ever free what it waits for): the plugin that answered (the hook is *firstresult*,
        so where several implement it, the first of them that answered) and its reason."""
        answering = [name for name in self.host.names
                     if "accelopt_allocate" in self.host.hooks_of(name)]
        who = (f"plugin '{answering[0]}'" if len(answering) == 1 else
               "plugin " + " or ".join(f"'{n}'" for n in answering) + " (the first to answer)")
        reason = f"its reason: {decision.reason!r}" if decision.reason else "no reason given"
        return (f"{who} refused its iteration while nothing else ran (accelopt_allocate, "
                f"{reason}): it would wait forever; grant an iteration when no other runs, or "
                "answer None for it")

    def events(self, job: Job, lane: str) -> StepEvents:
        """The events of ``job``'s iterations in ``lane`` (its host: run-scoped plugins plus
        the job's own job-scoped instances), on this driver's clock."""
        key = (job.info.job_id, lane)
        events = self._events.get(key)
        if events is None:
            events = StepEvents(self.plugins.for_job(job.info.job_id), lane, self._clock,
                                origin=self._t0,
                                serial=self._serial_events)
            self._events[key] = events
        return events

    def _iterate(self, entry: _Entry, lane: str) -> None:
        """One iteration of ``entry``'s job, called and returning with the driver's lock
        held (released around the step and the per-iteration callback)."""
        job, result = entry.job, entry.result
        iteration = job.iteration
        cv = self._cv
        try:  # released inside: a signal between release and try would leave it released
            cv.release()
            start = self._clock() - self._t0  # self.now(), inline: this runs every iteration
            error = None
            step: IterationResult | None = None
            try:
                events = entry.events
                if events is None or events.lane != lane:
                    events = entry.events = self.events(job, lane)
                step = job.step(events) if self.stepper is None else self.stepper(job, events)
            except Exception as exc:
                if raised_by_hook(exc) or not self._jobs_fail_alone:
                    raise  # a plugin's error stops the run, as any hook's does
                # the job's own code raised: the job fails alone; the run goes on
                error = f"{type(exc).__name__}: {exc}"
                result.error_traceback = traceback.format_exc()  # type: ignore[attr-defined]
            # the iteration's time is the whole call: what accelopt_iteration_end's plugins
            # do after the step's result was made costs the job too (its span, service time
            # and samples/s count it); the lock's wait below does not
            end = self._clock() - self._t0
        finally:
            cv.acquire()
        entry.busy = False
        self._running -= 1
        seconds = end - start
        if result.first_start_s is None:
            result.first_start_s = start
        result.service_s += seconds
        self._lane_spans.append((job.info.name, entry.lane, start, end, iteration))
        if step is None:
            self._finish(entry, "failed", error or "the iteration produced no result", end)
            return
        entry.last_iteration_s = seconds
        result.job = job.info
        result.iterations_done = job.iteration
        result.samples += step.samples
        if step.loss is not None:
            result.losses.append(step.loss)
            result.final_loss = step.loss
        if self.on_iteration is not None:
            try:
                cv.release()
                self.on_iteration(job, result)  # outside the lock: a checkpoint writes a file
            finally:
                cv.acquire()
        if job.iteration >= job.info.iterations or entry.cancel_requested:
            self._after(entry, end)

    def _after(self, entry: _Entry, end: float) -> None:
        """End the job if that was its last iteration or it was cancelled meanwhile."""
        if entry.finished:
            return
        if entry.job.done:
            self._finish(entry, "done", "", end)
        elif entry.cancel_requested:
            self._finish(entry, "failed", CANCELLED, end)

    def _finish(self, entry: _Entry, status: str, error: str, end: float | None = None, *,
                on_clock: bool = True) -> None:
        """Record a job's end (now, unless ``end`` says when), release its memory, admit the
        pending jobs that now fit and wake everyone. ``on_clock=False``: the job ended before
        the run's clock started (its profiling raised), so it has no end on that clock; the
        time of its failure would read as a JCT and stretch the makespan by the profiling."""
        entry.result.status = status  # type: ignore[assignment]
        entry.finished = status in ENDED
        entry.result.error = error
        entry.result.end_s = None if not on_clock else self.now() if end is None else end
        with contextlib.suppress(ValueError):  # a job never admitted is in no lane's list
            self._in_lane.get(entry.lane, []).remove(entry)
        if entry.lane:  # only an admitted job holds memory to give back
            self.host.call("accelopt_release", job=entry.job.info, lane=entry.lane, status=status)
        if self.on_finish is not None:
            self.on_finish(entry.job, entry.result)
        if entry.lane and self._fatal is None:
            # here, not on the driving thread when it next wakes: the lane that ran this job
            # chooses its next one as soon as this returns, and a job waiting for the memory
            # just freed must be among those it chooses from, not started an iteration late
            self._admit_pending()
        self._cv.notify_all()


_WAIT = object()
