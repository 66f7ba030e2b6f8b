"""The SALUS hook implementations: lanes (allocation), policies (iteration boundary), metrics.

How SALUS maps onto the core (see README.md):

* ``accelopt_allocate(phase="admission")`` = the lane manager's admission (new lane first,
  then best fit, else defer, or reject with the amount over capacity);
  ``accelopt_release`` returns the memory, removes an empty lane, shrinks the others; the core
  rescans every pending job in arrival order right after.
* ``accelopt_allocate(phase="iteration")`` = the second guard: reserve the lane's ephemeral
  memory for this iteration (refused -> the iteration waits).
* ``accelopt_select_next`` = the policy, per lane, at every iteration boundary.
* ``accelopt_iteration_start/end``: per-lane CPU thread count (or, on CUDA, the lane's
  MemPool and stream), refined iteration-time estimates, switch-latency samples, re-layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from accelopt_plugins.salus.cuda_lanes import CudaLanes
from accelopt_plugins.salus.lanes import LaneManager
from accelopt_plugins.salus.metrics import (
    Interval,
    busy_fraction,
    contention_fairness,
)
from accelopt_plugins.salus.policies import Policy, make_policy, read_history, resolve_auto

from accelopt import (
    AllocationDecision,
    AllocationRequest,
    CliCommand,
    ConfigError,
    IterationContext,
    IterationResult,
    JobInfo,
    JobState,
    ReportRow,
    RunInfo,
    UserError,
    hookimpl,
)
from accelopt.drivers.setup import MAX_THREADS, capacity_beyond_device, usable_cores
from accelopt.plugin import PluginWarning
from accelopt.report.metrics import percentile
from accelopt.units import format_bytes, parse_bytes

CPU_NOTE = "lanes are accounted, not enforced (CPU: no device allocator to partition)"
CUDA_NOTE = "lanes are real torch.cuda.MemPool pools with one CUDA stream each"
CLUSTER_NOTE = ("decided on the leader (rank 0) and broadcast, every rank running the chosen "
                "iteration; every rank keeps every job resident, so a switch costs no reload; "
                "lanes order iterations but do not run them concurrently (one iteration uses "
                "every rank); jobs are not memory-profiled in a cluster run, so lanes are "
                "accounted with 0 bytes")
EMA = 0.3
"""Weight of the newest measured iteration time in a job's refined estimate."""


@dataclasses.dataclass(frozen=True)
class SettingNames:
    """What the user set salus's threads and lanes with, for the warning that tells them to
    lower one: a packed sweep was told to lower ``plugins.salus.threads``, a key its command
    line never had (it gave ``hydra.launcher.threads``)."""

    threads: str = "plugins.salus.threads"
    max_lanes: str = "plugins.salus.max_lanes"


RUN_SETTINGS = SettingNames()
"""``accelopt run +plugins=[salus]`` (the runs' own salus under the launcher too)."""
SERVE_SETTINGS = SettingNames("--threads", "--max-lanes")
"""``accelopt serve``: its flags."""
LAUNCHER_SETTINGS = SettingNames("hydra.launcher.threads", "hydra.launcher.max_lanes")
"""``hydra/launcher=salus`` without the runs' own salus: the launcher's settings."""

_BUILT_FOR: ContextVar[SettingNames] = ContextVar("salus_setting_names", default=RUN_SETTINGS)


@contextmanager
def settings_named(names: SettingNames) -> Iterator[None]:
    """Every salus built inside (:attr:`SalusPlugin.setting_names`) names its settings as
    ``names``: for a builder that does not construct the plugin itself (the launcher's
    shared execution builds it from the config, in the core)."""
    token = _BUILT_FOR.set(names)
    try:
        yield
    finally:
        _BUILT_FOR.reset(token)


class SalusPlugin:
    """One execution service's scheduling brain (all hooks are called under the core's lock)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.policy: Policy = make_policy(resolve_auto(str(config.policy), "none"))
        self.policy_auto = str(config.policy) == "auto"
        self.capacity: int | None = None
        self.max_lanes = 0
        self.deterministic = True
        self.device = "cpu"
        self.run_dir: Path | None = None
        self.manager: LaneManager | None = None
        self.cores = usable_cores()
        self._fixed_threads: int | None = None
        self._estimates: dict[str, float] = {}
        self._warmed_up: set[str] = set()
        self._intervals: list[Interval] = []
        self._switch: list[float] = []
        """Switches between resident jobs (the chosen one had run before): SALUS's switch."""
        self._start: list[float] = []
        """Switches to a job's first iteration: its start-up in the lane (lazy set-up, first
        allocations), reported apart."""
        self._continue: list[float] = []
        self._last_end: dict[str, tuple[str, float]] = {}
        """The last iteration's (job, end) per lane, or under one key for every lane in a
        cluster run (:meth:`_end_key`)."""
        self._boundary: dict[str, tuple[str, float, float]] = {}
        """Per lane, the last choice: (job, when it was admitted, when the lane asked)."""
        self._admitted_at: dict[str, float] = {}
        self._left_at: dict[str, float] = {}
        self._first_start: dict[str, float] = {}
        self._arrived_at: dict[str, float] = {}
        self._status: dict[str, str] = {}
        self._names: dict[str, str] = {}
        self._rejected: dict[str, str] = {}
        self._deferrals = 0
        self._guard_waits = 0
        self._lane_jobs: dict[str, set[str]] = defaultdict(set)
        self._cuda: CudaLanes | None = None
        self._lane_size_peak: dict[str, int] = {}
        self._profiled: dict[str, bool] = {}
        """Per job that asked for admission, whether it came with a memory profile: without
        one (run.profile=false) the lanes account it as 0 bytes, not as measured."""
        self._lock = threading.Lock()
        self.cluster_mode = "none"
        self.leader = True
        self.world_size = 1
        self.role = "single"
        self._capacity_setting = "plugins.salus.capacity; accelopt serve --capacity"
        """The setting that gave the capacity: what a rejection tells the user to raise."""
        self._decisions = 0
        self._iterations: dict[str, int] = defaultdict(int)
        self.warnings: list[str] = []
        """Settings that do not act as set (said once, as a warning, and in the report row)."""
        self._threads_warned = False
        self.setting_names = _BUILT_FOR.get()
        """The names the user gave the threads and lanes settings by (a builder that is not
        ``accelopt run`` sets its own: :data:`SERVE_SETTINGS`, :func:`settings_named`)."""

    # -- lifecycle -----------------------------------------------------------------------

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self.config = config
        cluster = getattr(run_config, "cluster", None)
        self.cluster_mode = str(getattr(cluster, "mode", "none") or "none")
        self.policy = make_policy(resolve_auto(str(config.policy), self.cluster_mode))
        self.policy_auto = str(config.policy) == "auto"
        self.policy.iteration_time = self.iteration_seconds
        if config.history:
            learn = getattr(self.policy, "learn", None)
            if not callable(learn):
                raise ConfigError(
                    f"plugins.salus.history is read only by a policy that learns job lengths "
                    f"(gittins); {config.policy!r} does not: drop it or set "
                    "plugins.salus.policy=gittins")
            learn(read_history(str(config.history)))
        if config.max_lanes < -1:
            raise ConfigError("plugins.salus.max_lanes must be -1 (policy default), 0 (as many "
                              f"as fit) or a positive count; got {config.max_lanes}")
        self.max_lanes = self.policy.max_lanes if config.max_lanes == -1 else int(config.max_lanes)
        if self.cluster_mode != "none" and config.max_lanes == -1:
            # an iteration uses every rank, so lanes cannot run at once: several would only
            # interleave their jobs in whatever order the leader's lane threads get the lock
            # (pack's jobs each in its own lane), so one lane, whose order the policy decides
            self.max_lanes = 1
        if not 0 <= config.threads <= MAX_THREADS:
            raise ConfigError(f"plugins.salus.threads must be in [0, {MAX_THREADS}] (0 = auto; "
                              f"this machine has {usable_cores()} cores); got {config.threads}")
        for key in ("headroom", "persistent_headroom"):  # nan compares False: checked apart
            value = float(getattr(config, key))
            if not (math.isfinite(value) and value >= 1.0):
                raise ConfigError(f"plugins.salus.{key} must be a finite number >= 1.0 (it "
                                  f"only ever adds safety margin), got {value}")
        if config.capacity:
            self.capacity = parse_bytes(str(config.capacity), "plugins.salus.capacity")
            if self.capacity <= 0:
                raise ConfigError("plugins.salus.capacity must be positive, e.g. 2GiB")
        run = getattr(run_config, "run", None)
        self._capacity_setting = capacity_setting(config, run)
        self.deterministic = bool(getattr(run, "deterministic", True))
        self.device = str(getattr(run, "device", "cpu"))
        # the run's thread budget: run.threads when set (a job alone runs with it), else
        # every usable core
        asked = int(getattr(run, "threads", 0) or 0)
        self.cores = min(asked, usable_cores()) if asked > 0 else usable_cores()
        lanes_for_threads = self.max_lanes if self.max_lanes > 0 else self.cores
        if config.threads:
            self._fixed_threads = int(config.threads)
        elif self.deterministic:
            # Fixed per job, whatever else runs: CPU kernels' results depend on the thread
            # count, and a job must end bitwise equal to the same job run alone.
            self._fixed_threads = max(1, self.cores // max(1, lanes_for_threads))

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        self.run_dir = Path(run.run_dir) if run.run_dir else None
        self.device = run.device
        self.leader = run.leader
        self.world_size = run.world_size
        self.role = str(run.role)
        self._names.update({j.job_id: j.name for j in run.jobs})
        if run.leader:  # once per run: every rank is told the same
            for line in unread_settings(self.config, self.cluster_mode, self.world_size):
                self._warn(line)
            self.check_capacity(run.device)
            self.check_threads(max(1, self.max_lanes))  # at least one lane opens

    def _warn(self, line: str) -> None:
        """Say ``line`` now (``warning: ...`` on the command line) and in the report row."""
        self.warnings.append(line)
        warnings.warn(line, PluginWarning, stacklevel=2)

    def check_capacity(self, device: str) -> None:
        """Warn when ``plugins.salus.capacity`` is more memory than the run's device has:
        lanes are packed against the setting, not the device, so the value reads as a limit
        that nothing holds. A cluster run does not read it (:func:`unread_settings` says so)."""
        if self.capacity is None or self.cluster_mode != "none":
            return
        import torch

        line = capacity_beyond_device(self.capacity, torch.device(device),
                                      f"plugins.salus.capacity={self.config.capacity}")
        if line is not None:
            self._warn(line)

    def check_threads(self, lanes: int) -> None:
        """Warn once when the threads per lane x the ``lanes`` open is more threads than the
        cores this process may use, as ``run.threads`` beyond them warns: the lanes'
        threads take turns on the cores and every op pays for it. Only a count the user set
        and could lower (auto never gives a lane more than its share); a cluster rank and
        CUDA lanes do not read it. The settings are named as the user gave them
        (:attr:`setting_names`)."""
        threads, cores = int(self.config.threads), usable_cores()
        if (self._threads_warned or self.lanes_take_turns or self.device.startswith("cuda")
                or threads <= max(1, cores // max(1, lanes))):
            return
        self._threads_warned = True
        names = self.setting_names
        self._warn(f"{names.threads}={threads} x {lanes} lane(s) is {threads * lanes} "
                   f"threads, more than the {cores} cores this process may use: their "
                   "threads take turns on them, so every op is slower and the times measure "
                   f"that; {names.threads}={max(1, cores // max(1, lanes))} or less (0: auto, "
                   f"the cores split between the lanes), or fewer lanes ({names.max_lanes})")

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        if not run.leader:
            return []  # decisions are the leader's; this rank only ran the chosen iterations
        return [ReportRow("salus", self.summary_line(), self.report_metrics())]

    @hookimpl
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        if self._cuda is not None:
            self._cuda.close()
        if self.run_dir is None or not run.leader:
            return
        document = {"summary": self.summary(), "jobs": self.job_table()}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "salus.json").write_text(json.dumps(document, indent=2) + "\n")

    @hookimpl
    def accelopt_cli_commands(self) -> Sequence[CliCommand]:
        from accelopt_plugins.salus.cli import commands

        return commands()

    # -- allocation ----------------------------------------------------------------------

    def _lanes(self, request: AllocationRequest) -> LaneManager:
        if self.manager is None:
            capacity = self.capacity or request.capacity_bytes
            if capacity is None:
                raise ConfigError("plugins.salus.capacity is not set and the run has no "
                                  "memory capacity; set plugins.salus.capacity=2GiB")
            self.capacity = int(capacity)
            self.manager = LaneManager(
                self.capacity,
                max_lanes=self.max_lanes,
                headroom=float(self.config.headroom),
                persistent_headroom=float(self.config.persistent_headroom),
                capacity_setting=self._capacity_setting,
            )
        return self.manager

    @hookimpl
    def accelopt_allocate(self, request: AllocationRequest) -> AllocationDecision:
        lanes = self._lanes(request)
        job = request.job
        self._names[job.job_id] = job.name
        if request.phase == "iteration":
            if lanes.reserve_iteration(job.job_id):
                return AllocationDecision(granted=True, lane=lanes.job_lane[job.job_id])
            self._guard_waits += 1
            return AllocationDecision(granted=False, reason="lane busy or out of memory")
        self._profiled[job.job_id] = job.profile is not None
        admission = lanes.admit(job.job_id, request.persistent_bytes, request.ephemeral_bytes)
        if admission.reject is not None:
            self._rejected[job.job_id] = admission.reject
            self._status[job.job_id] = "rejected"
            return AllocationDecision(granted=False, reject=f"job '{job.name}' {admission.reject}")
        if admission.lane is None:
            self._deferrals += 1
            return AllocationDecision(granted=False, reason=admission.reason)
        self._status[job.job_id] = "admitted"
        self._lane_jobs[admission.lane].add(job.job_id)
        self.check_threads(len(lanes.lanes))
        return AllocationDecision(granted=True, lane=admission.lane, reason=admission.reason)

    @hookimpl
    def accelopt_release(self, job: JobInfo, lane: str, status: str) -> None:
        self._status[job.job_id] = status
        finished = getattr(self.policy, "finished", None)
        if status == "done" and callable(finished):
            finished(job.job_id, job.iterations)  # its length is no secret once it is done
        self._close_cuda_context()
        if self.manager is None:
            return
        left = self.manager.release(job.job_id)
        if left is not None and left not in self.manager.lanes:
            if self._cuda is not None:
                self._cuda.retire(left)  # pool kept alive until the run ends (cuda_lanes.py)

    # -- iteration boundary --------------------------------------------------------------

    def iteration_seconds(self, state: JobState) -> float:
        """Refined estimate of one iteration: EMA of measured times, seeded by the profile.
        A job with neither (a cluster job before its second iteration) counts as 0 s: it is
        probed first, so its first real measurement comes soon."""
        estimate = self._estimates.get(state.job.job_id)
        if estimate is not None:
            return estimate
        if state.job.profile is not None:
            return state.job.profile.iteration_seconds
        return 0.0

    def _refine_estimate(self, job_id: str, seconds: float) -> None:
        """Fold one measured iteration into the job's EMA, except its first: that one pays
        the job's warm-up (allocator, lazy initialisation, a plugin planning in it, such as
        tictac tracing the model on a server) and would make a short job look long to SRTF
        until the EMA forgets it."""
        if job_id not in self._warmed_up:
            self._warmed_up.add(job_id)
            return
        old = self._estimates.get(job_id)
        self._estimates[job_id] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    @hookimpl
    def accelopt_select_next(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        for state in ready:
            self._admitted_at.setdefault(state.job.job_id, state.admitted_at_s)
        chosen = self.policy.select(lane, ready, now_s)
        admitted = next((s.admitted_at_s for s in ready if s.job.job_id == chosen), None)
        if admitted is None:
            raise UserError(
                f"salus policy {self.policy.name or type(self.policy).__name__!r} chose "
                f"{_what_was_chosen(chosen)}, which is not ready in "
                f"lane {lane}; its select() must return one of the ready job ids: "
                + ", ".join(s.job.job_id for s in ready))
        self._decisions += 1
        self._boundary[lane] = (chosen, admitted, now_s)
        return chosen

    @hookimpl
    def accelopt_iteration_start(self, context: IterationContext) -> None:
        if self.world_size > 1:
            return  # lanes split one process's cores; a cluster rank keeps run.threads
        if self.device.startswith("cuda"):
            self._lanes_on_cuda().enter(context.lane)
            return
        threads = self._fixed_threads
        if threads is None:
            active = max(1, len(self.manager.lanes) if self.manager else 1)
            threads = max(1, self.cores // active)
        import torch

        # Per calling thread with the OpenMP backend: each lane thread sets its own count.
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    @hookimpl
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        job_id, lane = context.job.job_id, context.lane
        if self.device.startswith("cuda"):
            self._lanes_on_cuda().exit()
        seconds = result.end_s - result.start_s
        self._iterations[job_id] += 1
        self._refine_estimate(job_id, seconds)
        self.policy.observe(job_id, seconds)
        self._intervals.append(Interval(job_id, lane, result.start_s, result.end_s))
        self._first_start.setdefault(job_id, result.start_s)
        self._arrived_at.setdefault(job_id, context.job.arrival_s)
        self._left_at[job_id] = result.end_s
        previous = self._last_end.get(self._end_key(lane))
        boundary = self._boundary.get(lane)
        if previous is not None and boundary is not None and boundary[0] == job_id:
            prev_job, prev_end = previous
            gap = max(0.0, result.start_s - prev_end)
            if boundary[1] > prev_end:
                pass  # it arrived after the previous iteration ended: no choice was made
            elif prev_job == job_id:
                self._continue.append(gap)
            elif self._iterations[job_id] == 1:
                # a job's first iteration: its start-up, from the lane asking which job runs
                # next (after what the previous iteration's end triggered: a finished job's
                # outputs, a checkpoint) to its start
                self._start.append(max(0.0, result.start_s - max(prev_end, boundary[2])))
            elif self._status.get(prev_job) not in ("done", "failed"):
                # SALUS's switch, between two resident jobs: measured as the boundary of a
                # job that goes on is, the previous iteration's end to the next one's start
                self._switch.append(gap)
        self._last_end[self._end_key(lane)] = (job_id, result.end_s)
        if self.manager is not None:
            lane_obj = self.manager.lanes.get(lane)
            if lane_obj is not None:
                self._lane_size_peak[lane] = max(self._lane_size_peak.get(lane, 0), lane_obj.size)
            self.manager.end_iteration(job_id)

    @property
    def lanes_take_turns(self) -> bool:
        """A cluster run: the leader runs one broadcast iteration at a time whatever the
        lanes, so lanes order iterations but never run them at once."""
        return self.world_size > 1 or self.role != "single"

    def _end_key(self, lane: str) -> str:
        """Whose previous iteration end a gap is measured from: the lane's own on one device
        (lanes run at once, each its own sequence of iterations); in a cluster the previous
        iteration on any lane, since that is what ran just before (measuring from the lane's
        own last end would count the other lanes' iterations in between as the gap)."""
        return "" if self.lanes_take_turns else lane

    # -- CUDA lanes (plugins/salus/cuda_lanes.py) -----------------------------------------

    def _lanes_on_cuda(self) -> CudaLanes:
        if self._cuda is None:
            self._cuda = CudaLanes()
        return self._cuda

    def _close_cuda_context(self) -> None:
        """A job failed mid-iteration on CUDA: leave its lane's pool (same thread)."""
        if self._cuda is not None:
            self._cuda.exit(synchronize=False)

    # -- figures ---------------------------------------------------------------------------

    def _wanted_from(self, job_id: str) -> float:
        """Since when the job wanted the device, for fairness: its arrival (a job waiting
        for admission is served nothing), else the earliest of its admission and first
        iteration. Every policy gets the same rule, so PACK's concurrent lanes, which never
        ask a lane to choose between jobs, are measured like time-sharing policies."""
        first = self._first_start[job_id]
        arrived = self._arrived_at.get(job_id)
        if arrived is not None and 0.0 <= arrived <= first:
            return arrived
        return min(self._admitted_at.get(job_id, first), first)

    def lanes_note(self) -> str:
        if self.lanes_take_turns:
            return CLUSTER_NOTE
        return CUDA_NOTE if self.device.startswith("cuda") else CPU_NOTE

    def summary(self) -> dict[str, Any]:
        """Every figure the plugin measured (also written to ``salus.json``)."""
        m = self.manager
        intervals = self._intervals
        start = min((i.start_s for i in intervals), default=0.0)
        end = max((i.end_s for i in intervals), default=0.0)
        active = {j: (self._wanted_from(j), self._left_at[j]) for j in self._left_at}
        window = max((end - start) / 50.0, 1e-3)
        fairness, windows = contention_fairness(intervals, active, window)
        return {
            "policy": self.policy.name or type(self.policy).__name__,
            "decisions": self._decisions,
            "iterations": sum(self._iterations.values()),
            "world_size": self.world_size,
            "max_lanes": self.max_lanes,
            "device": self.device,
            "lanes_note": self.lanes_note(),
            "capacity_bytes": self.capacity,
            "peak_accounted_bytes": m.peak_used if m else 0,
            "unprofiled_jobs": sum(not p for p in self._profiled.values()),
            "peak_lanes": m.peak_lanes if m else 0,
            "peak_resident_jobs": m.peak_jobs if m else 0,
            "lanes_opened": m.lanes_opened if m else 0,
            "relayouts": m.relayouts if m else 0,
            "open_lanes_at_end": len(m.lanes) if m else 0,
            "deferrals": self._deferrals,
            "guard_waits": self._guard_waits,
            "threads_per_lane": self._fixed_threads if self._fixed_threads else "auto",
            "busy_fraction": busy_fraction(intervals, start, end),
            "jain_fairness": fairness,
            "contention_windows": windows,
            "switches": len(self._switch),
            "switch_latency_median_s": percentile(self._switch, 50),
            "switch_latency_p99_s": percentile(self._switch, 99),
            "boundary_latency_median_s": percentile(self._continue, 50),
            "first_iteration_switches": len(self._start),
            "first_iteration_latency_median_s": percentile(self._start, 50),
            "failed": sorted(j for j, s in self._status.items() if s == "failed"),
            "rejected": dict(self._rejected),
            "cuda_pool_peak_bytes": dict(self._cuda.pool_peak) if self._cuda else {},
            "cuda_routing": self._cuda.routing if self._cuda else None,
            "lane_size_peak_bytes": dict(self._lane_size_peak),
            "warnings": list(self.warnings),
        }

    def job_table(self) -> list[dict[str, Any]]:
        rows = []
        for job_id in sorted(self._status):
            lane = next((ln for ln, jobs in self._lane_jobs.items() if job_id in jobs), "")
            rows.append({"job_id": job_id, "name": self._names.get(job_id, job_id),
                         "status": self._status[job_id], "lane": lane,
                         "iterations_run": self._iterations.get(job_id, 0)})
        return rows

    def report_metrics(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {}
        for key, value in self.summary().items():
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                out[key] = value
        return out

    def memory_line(self, s: dict[str, Any]) -> str:
        """The accounted memory against the capacity, unless jobs came without a memory
        profile (run.profile=false): then what the lanes packed against was no estimate, and
        "0 B" would read as measured. A cluster run's lanes note says it for its own reason."""
        capacity = format_bytes(s["capacity_bytes"] or 0)
        accounted = (f"peak accounted memory {format_bytes(s['peak_accounted_bytes'])} of "
                     f"{capacity}")
        unprofiled = s["unprofiled_jobs"]
        if not unprofiled or self.lanes_take_turns:
            return accounted
        if unprofiled == len(self._profiled):
            return (f"no memory accounted against the {capacity} capacity: the jobs were not "
                    "memory-profiled (run.profile=false), so lanes and packing had no "
                    "estimates of their memory")
        return (f"{accounted}, {unprofiled} of {len(self._profiled)} job(s) not "
                "memory-profiled (run.profile=false) and counted as 0 B")

    def summary_line(self) -> str:
        s = self.summary()
        m = self.manager
        if m is None or not self._status:
            return "; ".join([f"policy {s['policy']}: no job reached admission; nothing to "
                              "share", *self.warnings])
        n_jobs = len([st for st in self._status.values() if st != "rejected"])
        chosen_by = "" if not self.policy_auto else (
            " (auto: srtf in a cluster)" if self.world_size > 1 else " (auto: pack on one device)")
        lanes = "lane(s) open, taking turns" if self.lanes_take_turns else "concurrent lane(s)"
        parts = [
            f"policy {s['policy']}{chosen_by}: {n_jobs} job(s) in {s['lanes_opened']} lane(s) "
            f"(peak {s['peak_lanes']} {lanes}, {s['peak_resident_jobs']} resident "
            f"job(s) vs 1 under exclusive allocation); {s['decisions']} choices between ready "
            f"jobs over {s['iterations']} iterations",
            self.memory_line(s),
        ]
        if s["switch_latency_median_s"] is not None:
            parts.append(
                f"switch latency median {s['switch_latency_median_s'] * 1e3:.3f} ms, p99 "
                f"{s['switch_latency_p99_s'] * 1e3:.3f} ms over {s['switches']} switches "
                "between resident jobs"
            )
        if s["first_iteration_latency_median_s"] is not None:
            parts.append(
                f"a job's first iteration started {s['first_iteration_latency_median_s'] * 1e3:.3f}"
                f" ms (median) after the lane chose it among waiting jobs "
                f"({s['first_iteration_switches']} such starts; a start with no choice is not "
                "timed): its start-up, not a switch"
            )
        if self.world_size == 1 and not self.device.startswith("cuda"):
            threads = s["threads_per_lane"]
            parts.append("the cores re-split between active lanes every iteration"
                         if threads == "auto" else
                         f"{threads} intra-op thread(s) per lane (a job's numerics follow its "
                         "thread count)")
        note = self.policy.note() if hasattr(self.policy, "note") else None
        if note:
            parts.append(note)
        if n_jobs == 1:
            parts.append("only one job: nothing to share, it ran alone")
        if s["failed"]:
            parts.append(f"{len(s['failed'])} failed, lane memory reclaimed: "
                         + ", ".join(self._names.get(j, j) for j in s["failed"]))
        if s["rejected"]:
            parts.append(f"{len(s['rejected'])} rejected (never fit)")
        parts += self.warnings
        parts.append(self.lanes_note())
        return "; ".join(parts)


MEMORY_SETTINGS = ("capacity", "headroom", "persistent_headroom")
"""salus's settings that act only on jobs' profiled memory (the lanes' accounting)."""


def unread_settings(config: Any, cluster_mode: str, world_size: int) -> list[str]:
    """A line for salus's settings, set to other than their defaults, that this run does not
    read, as ``run.memory_capacity`` is said to be: a cluster run (``cluster.mode`` other than
    ``none``) does not profile jobs' memory, so the lanes account 0 bytes whatever the
    capacity and margins; a cluster rank (world_size > 1) keeps ``run.threads``."""
    from accelopt_plugins.salus import SalusConfig

    default = SalusConfig()
    lines = []
    if cluster_mode not in ("", "none"):
        named = [f"plugins.salus.{key}={getattr(config, key)}" for key in MEMORY_SETTINGS
                 if str(getattr(config, key)) != str(getattr(default, key))]
        if named:
            verb, it = ("has", "it") if len(named) == 1 else ("have", "them")
            lines.append(f"{', '.join(named)} {verb} no effect: cluster.mode={cluster_mode} "
                         "does not profile jobs' memory (every rank keeps every job resident),"
                         f" so lanes are accounted with 0 bytes and nothing is admitted or "
                         f"rejected by {it}; cluster.mode=none enforces {it}")
    if world_size > 1 and int(config.threads) != default.threads:
        lines.append(f"plugins.salus.threads={config.threads} has no effect: a cluster rank "
                     "keeps its own thread count (every rank runs each iteration, one at a "
                     "time); set run.threads")
    return lines


def capacity_setting(config: Any, run: Any) -> str:
    """The setting that gives salus its capacity, named in a rejection's hint: its own
    (``plugins.salus.capacity``, which ``accelopt serve --capacity`` sets), else the run's
    ``run.memory_capacity`` when set, else the device's memory, which either can override."""
    if config.capacity:
        return "plugins.salus.capacity; accelopt serve --capacity"
    if str(getattr(run, "memory_capacity", "auto") or "auto") != "auto":
        return "run.memory_capacity"
    return ("it is the device's memory: set plugins.salus.capacity or run.memory_capacity; "
            "accelopt serve --capacity")


def _what_was_chosen(chosen: object) -> str:
    """A policy's answer as its refusal names it: a string as it is, anything else by its
    type, with the id to return for a ``JobState`` (the likeliest slip: returning
    ``ready[i]``, whose whole repr made a line of 1.5 KB)."""
    if isinstance(chosen, str):
        return repr(chosen)
    if isinstance(chosen, JobState):
        return f"a JobState (return its .job.job_id, {chosen.job.job_id!r})"
    return f"a {type(chosen).__name__}"

